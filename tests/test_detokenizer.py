"""Incremental detokenization: token by token, the text equals decoding the whole output at once,
with multi-byte characters split across tokens held back until complete."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engram.engine.detokenizer import detokenize_step
from engram.engine.request import SamplingParams
from engram.engine.sequence import Sequence
from engram.models.embedded import ensure_embedded_model

TEXT = "Hello, wörld! 你好 🙂 — ünïcode split across byte tokens."


class WindowDecoder:
    """A tokenizer without a `tokenizers` backend: detokenization falls back to window decoding."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("backend", ["decode_stream", "window"])
def test_incremental_text_equals_full_decode(backend):
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT)  # byte-level: some characters span several tokens
    tok = tokenizer if backend == "decode_stream" else WindowDecoder(tokenizer)
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    texts = []
    for t in ids:
        seq.token_ids.append(t)
        detokenize_step(tok, seq)
        texts.append(seq.text)
        assert "\ufffd" not in seq.text  # a partial character is never shown
    assert seq.text == tokenizer.decode(ids) == TEXT
    assert (seq.decode_stream is not None) == (backend == "decode_stream")
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:]))  # text only grows
