"""Continuous batching with chunked prefill over one flat token budget per step.

Running sequences go first (a decode is a chunk of one token); waiting sequences are admitted
while a state slot, KV pages for their first chunk and token budget remain. When KV pages run
out mid-decode, the most recently admitted sequence is preempted: its slot and pages are freed
and it is recomputed later (from its restored snapshot, if it came with one), exactly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engram.engine.pools import KVPool, StatePool
from engram.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position fed this step (== seq.num_computed)
    length: int

    @property
    def completes(self) -> bool:
        """After this chunk the state covers every token: the next token can be sampled."""
        return self.start + self.length == len(self.seq.token_ids)


class Scheduler:
    def __init__(self, state_pool: StatePool, kv_pool: KVPool, max_running: int, max_batched_tokens: int):
        self.state_pool = state_pool
        self.kv_pool = kv_pool
        self.max_running = min(max_running, state_pool.num_slots)
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.kv_pool.blocks_for(num_tokens) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.kv_pool.num_free:
            return False
        seq.blocks.extend(self.kv_pool.allocate(need))
        return True

    def release(self, seq: Sequence) -> None:
        """Give back the sequence's slot and pages (finish, abort or preemption)."""
        if seq.slot is not None:
            self.state_pool.free(seq.slot)
            seq.slot = None
        self.kv_pool.free(seq.blocks)
        seq.blocks = []
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
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def schedule(self) -> tuple[list[ScheduledChunk], list[Sequence]]:
        """Chunks for this step, and the sequences admitted now (whose state must be restored)."""
        budget = self.max_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted below by an earlier sequence
                continue
            n = min(seq.num_uncomputed, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                chunks.append(ScheduledChunk(seq, seq.num_computed, n))
                budget -= n

        admitted: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_running and self.state_pool.num_free:
            seq = self.waiting[0]
            start = seq.num_cached_tokens if seq.initial_state is not None else 0
            n = min(len(seq.token_ids) - start, budget)
            if self.kv_pool.blocks_for(start + n) > self.kv_pool.num_free:
                break
            self.waiting.popleft()
            seq.slot = self.state_pool.allocate()
            self._grow(seq, start + n)
            seq.num_computed = start
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            chunks.append(ScheduledChunk(seq, start, n))
            budget -= n
        return chunks, admitted
