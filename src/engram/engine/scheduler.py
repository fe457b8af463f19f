"""Continuous batching with chunked prefill over one flat token budget per step.

Running sequences go first (a decode is a chunk of one token); waiting sequences are admitted
while a state slot, KV pages for their first chunk and token budget remain. When KV pages run
out mid-decode, the most recently admitted sequence is preempted: its slot and pages are freed
and it is recomputed later (from its restored snapshot, if it came with one), exactly.

A finished sequence may keep its slot and pages (the ACTIVE tier, and the prefix cache's GPU
tier) so that the next turn of its conversation, or a prompt that extends it, adopts them without
copying any state. Retained slots only use what running work does not need: they are reclaimed,
prefix-cache slots first, each kind least recently used first, before anything is preempted.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engram.engine.pools import KVPool, StatePool
from engram.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position fed this step (== seq.num_computed)
    length: int  # tokens fed, the draft's included
    draft: list[int] = field(default_factory=list)  # speculative tokens fed after the sequence's own (engine/speculative.py)
    padding: int = 0  # filler positions fed after the draft, never kept: a verify step of a fixed width (a CUDA graph's)

    @property
    def own_length(self) -> int:
        """Tokens of the sequence's own fed (neither draft nor padding)."""
        return self.length - len(self.draft) - self.padding

    @property
    def known_tokens(self) -> list[int]:
        """The tokens fed that the host has: the sequence's own (but one still in flight), the draft,
        the padding's filler (the last token again)."""
        return self.seq.token_ids[self.start : self.start + self.own_length] + self.draft + self.seq.token_ids[-1:] * self.padding

    @property
    def completes(self) -> bool:
        """After this chunk the state covers every token: the next token can be sampled."""
        return self.start + self.own_length == self.seq.num_tokens

    @property
    def prompt_rows(self) -> range:
        """Positions of this chunk whose last hidden states its request asks for and has not had
        (prompt logprobs, an embedding): a recomputation after preemption asks for none again."""
        if not self.seq.wants_prompt_rows:
            return range(0)
        return range(max(self.start, self.seq.prompt_rows_done), min(self.start + self.length, self.seq.num_prompt_tokens))


@dataclass(eq=False)
class RetainedSlot:
    """A finished sequence's slot and KV pages, still holding its state after `state_len` tokens.
    The scheduler alone decides when it goes; `held` says whether it is still there, so that
    whoever was handed it (the conversation manager's ACTIVE tier) asks it instead of keeping a
    copy that could disagree."""

    slot: int
    blocks: list[int]
    tokens: list[int]
    state_len: int
    held: bool = True  # False once adopted by a request or freed (reclaimed, released, superseded)
    # A prefix-cache slot (`LLMEngine.add_request(prefix_slots=)`): reclaimed before the others, and
    # its tokens' bytes kept for `longest_retained` to compare a prompt against without a copy.
    cache_key: bytes | None = None


def token_bytes(tokens: list[int]) -> bytes:
    """Token ids as bytes (8 each): one sequence's prefix of another's is a bytes prefix."""
    return array("q", tokens).tobytes()


class Scheduler:
    def __init__(
        self,
        state_pool: StatePool,
        kv_pool: KVPool,
        max_running: int,
        max_batched_tokens: int,
        mixed_chunks: bool = False,
        delay_factor: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if delay_factor < 0:
            raise ValueError(f"--scheduler-delay-factor must be at least 0, got {delay_factor}")
        self.state_pool = state_pool
        self.kv_pool = kv_pool
        self.max_running = min(max_running, state_pool.num_slots)
        self.max_batched_tokens = max_batched_tokens
        self.mixed_chunks = mixed_chunks
        self.delay_factor = delay_factor
        self.clock = clock
        self._prefilled_last = False  # the last step (with mixed_chunks off) ran prefill chunks only
        self._admitted_at: float | None = None  # when the last step that admitted sequences was scheduled
        self._admitting_step_seconds = 0.0  # and how long that step took (until the next schedule)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.retained: OrderedDict[str, RetainedSlot] = OrderedDict()
        # The prefix-cache slots of `retained`, republished whole on each change, so that other
        # threads may read them (`longest_retained`) while this one schedules.
        self._cache_slots: tuple[tuple[str, RetainedSlot], ...] = ()
        self.num_preemptions = 0
        self.num_reclaimed = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival_time = self.clock()
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.kv_pool.blocks_for(num_tokens) - len(seq.blocks)
        if need <= 0:
            return True
        while need > self.kv_pool.num_free and self.retained:
            self.drop_retained(self._reclaimable())
        if need > self.kv_pool.num_free:
            return False
        seq.blocks.extend(self.kv_pool.allocate(need))
        return True

    # ---- the ACTIVE tier --------------------------------------------------------------------

    def retain(self, key: str, seq: Sequence, cache: bool = False) -> RetainedSlot:
        """Keep a finished sequence's slot and pages under `key` instead of freeing them (`cache`: as
        a prefix-cache slot)."""
        self.drop_retained(key)  # an older state under the same key is superseded
        assert seq.slot is not None, "a finished sequence keeps its slot until it is freed or retained"
        tokens = list(seq.token_ids)
        cache_key = token_bytes(tokens[: seq.num_computed]) if cache else None
        kept = self.retained[key] = RetainedSlot(seq.slot, seq.blocks, tokens, seq.num_computed, cache_key=cache_key)
        seq.slot, seq.blocks = None, []
        if cache:
            self._publish_cache_slots()
        return kept

    def adopt(self, key: str) -> RetainedSlot | None:
        """Take a retained slot out of the pool of reclaimable ones (it now belongs to a request)."""
        kept = self.retained.pop(key, None)
        if kept is not None:
            kept.held = False
            if kept.cache_key is not None:
                self._publish_cache_slots()
        return kept

    def longest_retained(self, prompt: list[int], namespace: str, longer_than: int = 0) -> tuple[str, int] | None:
        """The key and length of the prefix-cache slot, among those whose keys start with
        `namespace`, whose state covers the longest prefix of `prompt` (more than `longer_than`
        tokens, and not the whole prompt). Each candidate costs one memcmp of its tokens' bytes.
        Safe from any thread; from another than the scheduler's, a hint: the slot may be gone by
        the time a request for it is added."""
        best, best_len, prompt_key = None, longer_than, b""
        for key, kept in self._cache_slots:
            n = kept.state_len
            if not best_len < n < len(prompt) or not key.startswith(namespace) or kept.tokens[n - 1] != prompt[n - 1]:
                continue
            prompt_key = prompt_key or token_bytes(prompt)
            if prompt_key.startswith(kept.cache_key or b""):
                best, best_len = key, n
        return (best, best_len) if best is not None else None

    @property
    def num_cache_slots(self) -> int:
        """Of the retained slots, the prefix cache's."""
        return len(self._cache_slots)

    def _publish_cache_slots(self) -> None:
        self._cache_slots = tuple((key, kept) for key, kept in self.retained.items() if kept.cache_key is not None)

    def drop_retained(self, key: str) -> bool:
        kept = self.retained.pop(key, None)
        if kept is not None:
            self.free_retained(kept)
            if kept.cache_key is not None:
                self._publish_cache_slots()
        return kept is not None

    def free_retained(self, kept: RetainedSlot) -> None:
        kept.held = False
        self.state_pool.free(kept.slot)
        self.kv_pool.free(kept.blocks)
        self.num_reclaimed += 1

    def _free_slot_available(self) -> bool:
        while not self.state_pool.num_free and self.retained:
            self.drop_retained(self._reclaimable())
        return self.state_pool.num_free > 0

    def _reclaimable(self) -> str:
        """The retained slot to free first: the oldest prefix-cache slot, else the oldest of all
        (a conversation's turn is adopted far more often than a one-shot request's prefix)."""
        return next((key for key, kept in self.retained.items() if kept.cache_key is not None), next(iter(self.retained)))

    def release(self, seq: Sequence) -> None:
        """Give back the sequence's slot and pages (finish, abort or preemption)."""
        if seq.slot is not None:
            self.state_pool.free(seq.slot)
            seq.slot = None
        self.kv_pool.free(seq.blocks)
        seq.blocks = []
        if seq.adopted is not None:  # never admitted: its adopted slot goes back
            self.free_retained(seq.adopted)
            seq.adopted = None
        if seq in self.running:
            self.running.remove(seq)

    def remove(self, seq: Sequence) -> None:
        self.release(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, victim: Sequence) -> None:
        self.release(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_computed = 0
        # An adopted slot went back with it: from now on only its initial_state (if any) is restored.
        victim.num_cached_tokens = victim.initial_state.state_len if victim.initial_state is not None else 0
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def schedule(self) -> tuple[list[ScheduledChunk], list[Sequence]]:
        """Chunks for this step, and the sequences admitted now (whose state must be restored).

        With `mixed_chunks` a step holds decode rows and prefill chunks together. Without it (as
        SGLang without --enable-mixed-chunk) a step holds one or the other, so that decode steps
        replay their CUDA graph; while prefill work lasts the two kinds take turns."""
        now = self.clock()
        if self._admitted_at is not None:
            self._admitting_step_seconds, self._admitted_at = now - self._admitted_at, None
        admit_at = now if self._admission_due(now) else None
        if self.mixed_chunks:
            chunks, admitted = self._schedule(decode=True, prefill=True, admit_at=admit_at)
        elif self._prefilled_last and any(seq.num_uncomputed == 1 for seq in self.running):
            self._prefilled_last = False
            chunks, admitted = self._schedule(decode=True, prefill=False)
        else:
            chunks, admitted = self._schedule(decode=False, prefill=True, admit_at=admit_at)
            self._prefilled_last = bool(chunks)
            if not chunks:
                chunks, admitted = self._schedule(decode=True, prefill=False)
        return chunks, admitted

    def _admission_due(self, now: float) -> bool:
        """vLLM's --scheduler-delay-factor: while sequences run, waiting ones are admitted once the
        oldest has waited `delay_factor` x the time of the last step that admitted any (or once they
        fill a step's token budget), so that requests arriving a few steps apart share one prefill
        step instead of each stopping the decode rows for a step of its own."""
        if self.delay_factor <= 0 or not self.running or not self.waiting:
            return True
        if sum(seq.num_tokens for seq in self.waiting) >= self.max_batched_tokens:
            return True
        oldest = min(seq.arrival_time for seq in self.waiting)
        return now - oldest >= self.delay_factor * self._admitting_step_seconds

    def _schedule(self, decode: bool, prefill: bool, admit_at: float | None = None) -> tuple[list[ScheduledChunk], list[Sequence]]:
        """Decode rows (running sequences with one token to feed) if `decode`; prefill chunks of
        running sequences if `prefill`, and admissions of waiting ones as well if `admit_at` (the
        step's start, which times the admitting step) is given."""
        budget = self.max_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: set[Sequence] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq in preempted:  # by an earlier sequence, below
                continue
            n = min(seq.num_uncomputed, budget)
            if n == 0:  # waits only for a token in flight that ends it (by length): nothing to compute
                continue
            if not (decode if seq.num_uncomputed == 1 else prefill):
                continue
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(victim)
                if victim is seq:
                    break
            if seq not in preempted:
                chunks.append(ScheduledChunk(seq, seq.num_computed, n))
                budget -= n

        admitted: list[Sequence] = []
        if not prefill or admit_at is None:
            return chunks, admitted
        blocked = False  # a sequence found no room: only those behind it that hold an adopted slot go on
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_running:
                break
            adopted = seq.adopted
            if blocked and adopted is None:
                continue
            start = adopted.state_len if adopted else (seq.initial_state.state_len if seq.initial_state else 0)
            n = min(seq.num_tokens - start, budget)
            if adopted is None and not (self._fits(start + n) and self._free_slot_available()):  # no slot dropped for a refusal
                # An adopted slot is no longer reclaimable: were its holder left waiting behind this
                # sequence, nothing would ever free the room this one waits for.
                blocked = True
                continue
            self.waiting.remove(seq)
            self._admitted_at = admit_at
            if seq.queue_seconds is None:  # a preempted sequence's queue time is its first wait
                seq.queue_seconds = admit_at - seq.arrival_time
            if adopted is not None:  # the state is already in this slot and these pages
                seq.slot, seq.blocks, seq.adopted = adopted.slot, adopted.blocks, None
                self.state_pool.pending.settle([seq.slot])  # its capture may still be copying
            else:
                seq.slot = self.state_pool.allocate()
                admitted.append(seq)  # its state, if it has one, must be restored into the slot
            if not self._grow(seq, start + n):  # only an adopted sequence can lack pages here
                self._preempt(seq)
                break
            seq.num_computed = start
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, start, n))
            budget -= n
        return chunks, admitted

    def _fits(self, num_tokens: int) -> bool:
        """Whether pages for `num_tokens` are free or can be reclaimed from retained slots."""
        reclaimable = sum(len(r.blocks) for r in self.retained.values())
        return self.kv_pool.blocks_for(num_tokens) <= self.kv_pool.num_free + reclaimable
