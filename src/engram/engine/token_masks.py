"""vLLM's per-request token masks, applied to a step's logits before sampling: `allowed_token_ids`,
`bad_words` and `min_tokens` (EOS and stop tokens forbidden until that many tokens are out)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from engram.engine.sequence import Sequence


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word's token ids as it appears first and after a space, as vLLM bans them: the spaced
    form too when it is a different sequence of as many tokens."""
    if tokenizer is None:
        raise ValueError("bad_words: the model has no tokenizer")
    found: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        found.append(plain)
        if spaced[:1] != plain[:1] and len(spaced) == len(plain):
            found.append(spaced)
    return found


def banned_tokens(seq: Sequence, stop_ids: Iterable[int]) -> list[int]:
    """The tokens `seq` may not sample next: the last token of every bad word whose other tokens
    end the output, and the stop tokens while the output is shorter than min_tokens."""
    output = seq.output_token_ids
    banned = [ids[-1] for ids in seq.bad_words_ids if len(ids) == 1 or output[len(output) - len(ids) + 1 :] == ids[:-1]]
    if seq.num_output_tokens < seq.params.min_tokens:
        banned += list(stop_ids) + list(seq.params.stop_token_ids or [])
    return banned


@torch.inference_mode()  # the logits are the runner's inference tensors
def mask_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> None:
    """Mask, in place, what each row's request forbids (row i is seqs[i])."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.masks_tokens:
            continue
        if p.allowed_token_ids is not None:
            if seq.allowed_mask is None:
                seq.allowed_mask = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
                seq.allowed_mask[torch.tensor(p.allowed_token_ids, device=logits.device)] = False
            logits[row].masked_fill_(seq.allowed_mask, -torch.inf)
        banned = banned_tokens(seq, () if p.ignore_eos else eos_token_ids)
        if banned:
            logits[row, torch.tensor(banned, device=logits.device)] = -torch.inf
