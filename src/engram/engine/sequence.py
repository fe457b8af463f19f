"""A request inside the engine: its tokens, how many of them the state has consumed, its memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from engram.engine.request import FinishReason, SamplingParams, TokenLogprob
from engram.state.sequence_state import SequenceState

if TYPE_CHECKING:
    import xgrammar as xgr
    from tokenizers.decoders import DecodeStream

    from engram.engine.scheduler import RetainedSlot


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: identity equality (list membership in the scheduler stays O(1) per item)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]  # never mutated: every output of the request shares this list
    params: SamplingParams
    token_ids: list[int] = field(init=False)  # the prompt, then every generated token
    generator: torch.Generator | None = None
    initial_state: SequenceState | None = None  # restored on (re)admission
    capture_state: bool = False
    retain_key: str | None = None  # keep the slot and pages under this key when finished
    internal: bool = False  # made by the server for itself: its tokens count as neither received nor generated
    retain_cache: bool = False  # retained as a prefix-cache slot (reclaimed first)
    adopted: RetainedSlot | None = None  # a retained slot this request continues (until admitted)
    host_base: SequenceState | None = None  # a host state whose KV the pages hold for its positions (captures share it)
    staged_state: SequenceState | None = None  # initial_state's copy on the device, made by its load (until the first restore)
    retained: RetainedSlot | None = None  # where its final state was kept under retain_key (at finish)
    num_cached_tokens: int = 0  # prompt tokens whose state was restored or adopted, not computed
    restore_seconds: float = 0.0  # time to copy the restored state into the pools
    arrival_time: float = 0.0  # when the scheduler took it (its clock)
    queue_seconds: float | None = None  # from arrival to its first admission (None: still waiting)
    captured_state: SequenceState | None = None  # taken at finish when capture_state is set
    capture_prompt: bool = False  # also return the state after the prompt (a prefix-cache entry)
    prompt_recurrent: dict[str, torch.Tensor] | None = None  # its recurrent part, copied when the prefill ended
    prompt_state: SequenceState | None = None  # and with the prompt's KV, at finish
    prompt_mask: torch.Tensor | None = None  # the prompt's tokens over the vocabulary, for the repetition penalty
    output_counts: torch.Tensor | None = None  # each token's count in the output, for the penalties (once one needs it)
    matcher: xgr.GrammarMatcher | None = None  # of a request with structured outputs (engine/grammar.py)
    bad_words_ids: list[list[int]] = field(default_factory=list)  # params.bad_words as token ids (engine/token_masks.py)
    allowed_mask: torch.Tensor | None = None  # [V] bool, True outside params.allowed_token_ids (made on first use)
    embed: bool = False  # an embedding request: the prompt's last hidden states are summed
    prompt_rows_done: int = 0  # prompt positions whose hidden states were taken (prompt logprobs, embedding)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    hidden_sum: torch.Tensor | None = None  # float32 sum of the prompt's last hidden states (embed)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # tokens[:num_computed] are in the recurrent state and the KV cache
    num_inflight: int = 0  # 1 while a token sampled on the device is not yet read back (overlapped steps)
    inflight_row: int = 0  # that token's row in the runner's `sampled` buffer
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # Output bookkeeping for the next RequestOutput.
    text: str = ""
    emitted_tokens: int = 0
    emitted_chars: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    decode_stream: DecodeStream | None = None  # tokenizers' incremental decoder (fast tokenizers)
    prefix_offset: int = 0  # incremental detokenization window over the output tokens (others)
    read_offset: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def wants_prompt_rows(self) -> bool:
        """The request needs the last hidden state at every prompt position (not only the last)."""
        return (self.embed or self.params.prompt_logprobs is not None) and self.prompt_rows_done < self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def output_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Generated tokens [start:end] without copying the whole output first."""
        base = len(self.prompt_token_ids)
        return self.token_ids[base + start : base + (self.num_output_tokens if end is None else end)]

    @property
    def output_token_ids(self) -> list[int]:
        return self.output_ids()

    @property
    def num_tokens(self) -> int:
        """Every token of the sequence, the one still in flight included."""
        return len(self.token_ids) + self.num_inflight

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
