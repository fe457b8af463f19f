"""Incremental detokenization and stop strings.

Decodes a small window of output tokens per step (vLLM's prefix/read offsets), holding text back
while it ends in an incomplete UTF-8 sequence."""

from __future__ import annotations

from engram.engine.sequence import Sequence


def detokenize_step(tokenizer, seq: Sequence) -> None:
    """Extend `seq.text` with the text of newly generated tokens."""
    if tokenizer is None:
        return
    skip = seq.params.skip_special_tokens
    prefix_text = tokenizer.decode(seq.output_ids(seq.prefix_offset, seq.read_offset), skip_special_tokens=skip)
    full_text = tokenizer.decode(seq.output_ids(seq.prefix_offset), skip_special_tokens=skip)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        seq.text += full_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = seq.num_output_tokens


def find_stop_string(seq: Sequence, new_chars: int) -> str | None:
    """If a stop string appears in the text (looking only where new text could complete one),
    truncate the text before it and return it."""
    for stop in seq.params.stop:
        search_from = max(0, len(seq.text) - new_chars - len(stop) + 1)
        idx = seq.text.find(stop, search_from)
        if idx != -1:
            seq.text = seq.text[:idx]
            return stop
    return None
