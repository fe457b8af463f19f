"""Incremental detokenization and stop strings.

With a `tokenizers`-backed tokenizer (every fast tokenizer) each new token goes through the
library's `DecodeStream`, one call per token. Otherwise a small window of output tokens is decoded
per step (vLLM's prefix/read offsets). Both hold text back while it ends in an incomplete UTF-8
sequence."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engram.engine.sequence import Sequence


def detokenize_step(tokenizer: Any, seq: Sequence) -> None:
    """Extend `seq.text` with the text of the newly generated token."""
    if tokenizer is None:
        return
    skip = seq.params.skip_special_tokens
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer):
        if seq.decode_stream is None:
            seq.decode_stream = DecodeStream(skip_special_tokens=skip)
        seq.text += seq.decode_stream.step(backend, seq.token_ids[-1]) or ""
        return
    prefix_text = tokenizer.decode(seq.output_ids(seq.prefix_offset, seq.read_offset), skip_special_tokens=skip)
    full_text = tokenizer.decode(seq.output_ids(seq.prefix_offset), skip_special_tokens=skip)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        seq.text += full_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = seq.num_output_tokens


def find_stop_string(seq: Sequence, new_chars: int) -> str | None:
    """If a stop string appears in the text (looking only where new text could complete one),
    truncate the text before it (after it, with include_stop_str_in_output) and return it."""
    for stop in seq.params.stop_strings:
        search_from = max(0, len(seq.text) - new_chars - len(stop) + 1)
        idx = seq.text.find(stop, search_from)
        if idx != -1:
            seq.text = seq.text[: idx + len(stop) if seq.params.include_stop_str_in_output else idx]
            return stop
    return None


def stop_prefix_len(seq: Sequence) -> int:
    """Characters at the end of the text not yet emitted that could begin a stop string: a stream
    holds them back until the next tokens show whether the stop string follows (none when the
    stop string is kept in the output)."""
    if seq.params.include_stop_str_in_output:
        return 0
    pending = len(seq.text) - seq.emitted_chars
    held = 0
    for stop in seq.params.stop_strings:
        for k in range(min(len(stop) - 1, pending), held, -1):
            if seq.text.endswith(stop[:k]):
                held = k
                break
    return held
