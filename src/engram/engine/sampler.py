"""Next-token choice from logits: penalties, temperature, top-k, top-p, min-p, seeded sampling,
and logprobs of the model's own distribution.

Logits may live on the GPU. `sample_batch` takes the whole step at once: greedy rows without
penalties are one argmax on the device and one read-back of the token ids; every other row goes
through `sample_row`, which applies penalties and filters on the logits' device and draws from the
request's (CPU) generator, so seeded sampling gives the same tokens as on the CPU."""

from __future__ import annotations

from typing import Callable

import torch

from engram.engine.request import SamplingParams, TokenLogprob


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """vLLM semantics: repetition over prompt and output; frequency/presence over the output."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        ids, counts = torch.tensor(output_ids, device=logits.device).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (masked entries become -inf)."""
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), -torch.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), -torch.inf)
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int], generator: torch.Generator | None) -> int:
    logits = apply_penalties(logits.clone(), params, prompt_ids, output_ids)
    if params.greedy:
        return int(logits.argmax())
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: Callable[[int], tuple[list[int], list[int]]],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` [R, V]. `history(i)` gives row i's (prompt ids, output ids),
    asked only for rows whose penalties need them."""
    tokens = [0] * len(params)
    plain = [i for i, p in enumerate(params) if p.greedy and not p.has_penalties]
    if plain:
        rows = logits if len(plain) == len(params) else logits[torch.tensor(plain, device=logits.device)]
        for i, t in zip(plain, rows.argmax(dim=-1).tolist()):
            tokens[i] = t
    for i in sorted(set(range(len(params))) - set(plain)):
        prompt_ids, output_ids = history(i) if params[i].has_penalties else ([], [])
        tokens[i] = sample_row(logits[i], params[i], prompt_ids, output_ids, generators[i])
    return tokens


def token_logprob(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    entry = TokenLogprob(token_id, float(logprobs[token_id]))
    if top:
        values, ids = logprobs.topk(top)
        entry.top = list(zip(ids.tolist(), values.tolist()))
    return entry
