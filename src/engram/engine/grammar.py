"""Structured outputs: grammars compiled by xgrammar, and their token bitmask applied to a step's logits.

`Grammars.compile` turns a request's `StructuredOutputsParams` into an xgrammar `CompiledGrammar`.
It is thread-safe and cached by (kind, text) in xgrammar's compiler, so the server compiles off
the engine thread and a repeated schema costs a lookup. Each constrained sequence owns a
`GrammarMatcher` that accepts every token it samples. Before a step samples, `mask_logits` fills
the bitmask of every constrained row on the host (xgrammar's batch matcher) and sets the logits of
the tokens that the grammar forbids to -inf on the logits' device (xgrammar's CPU kernel, or its
Triton one on CUDA), so the logit bias, penalties and filters that follow see only allowed tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import xgrammar as xgr

from engram.engine.request import StructuredOutputsParams

# xgrammar's compiled-grammar cache: JSON-schema grammars of a large vocabulary take megabytes each.
CACHE_LIMIT_BYTES = 512 << 20
# xgrammar (through 0.2.9, mlc-ai/xgrammar#800) lowers a string with minLength/maxLength to this class,
# which admits raw control characters (U+0000-U+001F but CR and LF), invalid in JSON: they are taken out.
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


class GrammarError(ValueError):
    """A schema, regex, grammar or choice list that cannot be compiled (the request's fault)."""


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: each token id's bytes, as `from_huggingface` decodes them
    (byte-level, SentencePiece and tiktoken vocabularies alike), with special tokens emptied so that no
    grammar allows them (their text is dropped when decoding, so they could not match it) and only
    `stop_token_ids` ending the output. Ids past the tokenizer (a padded LM head) are never allowed."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    vocab = [b"" if i in special else token for i, token in enumerate(info.decoded_vocab)]
    return xgr.TokenizerInfo(
        vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids), add_prefix_space=info.add_prefix_space
    )


def choice_grammar(choices: list[str]) -> str:
    """EBNF that matches exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class Grammars:
    """The compiler for one engine's vocabulary and the reusable host bitmask of its steps."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        if tokenizer is None:
            raise GrammarError("structured outputs need the model's tokenizer; this model folder has none")
        self.vocab_size = vocab_size
        threads = min(8, os.cpu_count() or 1)
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info(tokenizer, vocab_size, stop_token_ids), max_threads=threads, cache_limit_bytes=CACHE_LIMIT_BYTES
        )
        self._batch = xgr.BatchGrammarMatcher(threads)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # engine thread only; grown as batches need

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Raises GrammarError naming `params.source` when the constraint cannot be compiled."""
        try:
            return self._compile(params)
        except (RuntimeError, ValueError) as e:  # xgrammar reports a bad schema, regex or grammar as RuntimeError
            raise GrammarError(f"{params.source}: {_reason(e)}") from None

    def _compile(self, p: StructuredOutputsParams) -> xgr.CompiledGrammar:
        any_whitespace = not p.disable_any_whitespace
        if p.json is not None:
            schema = json.dumps(p.json) if isinstance(p.json, dict) else p.json
            try:
                json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON: {e}") from None
            return self._compiler.compile_grammar(_json_schema_grammar(schema, any_whitespace))
        if p.json_object:
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if p.regex is not None:
            return self._compiler.compile_regex(p.regex)
        if p.choice is not None:
            return self._compiler.compile_grammar(choice_grammar(p.choice))
        assert p.grammar is not None
        return self._compiler.compile_grammar(p.grammar)

    @staticmethod
    def matcher(grammar: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(grammar)

    def mask_logits(self, logits: torch.Tensor, matchers: list[xgr.GrammarMatcher | None]) -> None:
        """Mask row i of `logits` [R, V] in place with matchers[i]'s next-token bitmask (None: unconstrained)."""
        constrained = [(i, m) for i, m in enumerate(matchers) if m is not None]
        if not constrained:
            return
        rows = [i for i, _ in constrained]
        if self._bitmask.shape[0] < len(matchers) or (logits.is_cuda and not self._bitmask.is_pinned()):
            self._bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
            if logits.is_cuda:
                self._bitmask = self._bitmask.pin_memory()
        bitmask = self._bitmask[: len(matchers)]
        self._batch.batch_fill_next_token_bitmask([m for _, m in constrained], bitmask, rows)
        # Pinned and queued: the host refills the buffer only after this step's tokens are read, so after the copy
        on_device = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, on_device, vocab_size=self.vocab_size, indices=rows)


def _json_schema_grammar(schema: str, any_whitespace: bool) -> str:
    """xgrammar's EBNF of a JSON schema, with bounded strings held to JSON's characters."""
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    return grammar.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ source location ("[16:45:37] /project/cpp/x.cc:94: ")."""
    text = str(error).strip()
    head, sep, tail = text.partition(": ")
    return tail.strip() if sep and head.startswith("[") and ".cc:" in head else text
