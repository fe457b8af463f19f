"""Request-level types shared by the engine, the offline API and the server (vLLM-shaped)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

from engram.state.sequence_state import SequenceState

if TYPE_CHECKING:
    from engram.engine.scheduler import RetainedSlot

# Temperatures below this count as 0 (greedy), as in vLLM: dividing logits by them overflows.
GREEDY_TEMPERATURE = 1e-5
SEED_RANGE = 2**64  # seeds are -2^63 .. 2^64 - 1, what torch.Generator takes


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one of a JSON schema (a dict or its JSON text), any JSON
    object, a regex, a list of choices or an EBNF grammar (xgrammar's dialect of GBNF). The output
    is held to it token by token and ends when it is complete (engine/grammar.py)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace beyond the separators
    source: str = "structured_outputs"  # the request field it came from, named in errors

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"{self.source}: give exactly one of json, regex, choice, grammar, json_object" + (f" (got {', '.join(given)})" if given else "")
            )
        if self.choice is not None and not self.choice:
            raise ValueError(f"{self.source}: the list of choices is empty")


@dataclass
class SamplingParams:
    """vLLM's names and defaults. `temperature` 0 (below GREEDY_TEMPERATURE) means greedy;
    `max_tokens` 0 computes the prompt's state and samples nothing (SGLang's `max_new_tokens` 0)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the sampled one)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the text of the stop string, stop token or EOS that ended it
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    structured_outputs: StructuredOutputsParams | None = None  # the grammar the output must follow
    min_tokens: int = 0  # EOS and stop tokens masked, stop strings not looked for, until this many are out
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never generate these words (their tokens, with and without a leading space)
    prompt_logprobs: int | None = None  # logprob of each prompt token and the top ones at its position

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list (what __post_init__ makes of it)."""
        assert isinstance(self.stop, list)
        return self.stop

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if "" in self.stop:
            raise ValueError("stop strings must not be empty")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be at least 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.01 <= self.repetition_penalty <= 100:
            raise ValueError(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and not -SEED_RANGE // 2 <= self.seed < SEED_RANGE:
            raise ValueError(f"seed must be in [-2^63, 2^64), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 20:
                raise ValueError(f"{name} must be in 0..20, got {getattr(self, name)}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.bad_words is not None and not all(word.strip() for word in self.bad_words):
            raise ValueError("bad_words must not be empty or blank")
        self.logit_bias = dict(self.logit_bias or {})
        for token, bias in self.logit_bias.items():
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)

    @property
    def masks_tokens(self) -> bool:
        """min_tokens, allowed_token_ids or bad_words: tokens masked per step (engine/token_masks.py)."""
        return self.min_tokens > 0 or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias: the row is adjusted on its own (`sampler.sample_adjusted`)."""
        return self.has_penalties or bool(self.logit_bias)


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    rank: int | None = None  # 1 + how many tokens are likelier (computed for prompt logprobs)


class SlotNotRetainedError(Exception):
    """A request that must adopt a retained slot (`require_adoption`) found none it could adopt:
    the caller fetches the state it falls back to and submits the request again with it."""


@dataclass
class RequestOutput:
    """A snapshot of a request's progress; the engine emits one per step that changed it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str  # detokenized output so far (without the stop string, stop token or EOS that ended it, unless asked)
    new_token_ids: list[int]  # generated since the previous output of this request
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprob] | None = None  # for new_token_ids, when requested
    num_cached_tokens: int = 0  # prompt tokens restored from state rather than computed
    restore_seconds: float = 0.0  # time spent loading a restored state into the engine's pools
    queue_seconds: float | None = None  # from add_request (the engine thread) to its admission (None: not yet admitted)
    state: SequenceState | None = None  # captured at finish when the request asked for it
    prompt_state: SequenceState | None = None  # the state after the prompt, when the request asked for it
    # vLLM's prompt logprobs, once the prompt is computed: None for the first token, then each token's
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's mean last hidden state, when finished
    retained: RetainedSlot | None = None  # the slot kept under the request's retain_key at finish (its `held` says while it is)


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output standing for two consecutive ones of a request: `later`, with both deltas."""
    logprobs = None if earlier.logprobs is None and later.logprobs is None else [*(earlier.logprobs or []), *(later.logprobs or [])]
    return replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids, new_text=earlier.new_text + later.new_text, logprobs=logprobs)
