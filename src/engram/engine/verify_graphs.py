"""CUDA graphs of speculative verify steps, one per decode batch bucket, all of one width W = k + 1.

A verify step is made graph-shaped by the speculator (`Speculator.pad_drafts`): every chunk feeds
W tokens, a short draft followed by filler positions that are never kept. Its inputs (token ids,
positions, KV slots, state slots, contexts, block tables) go from pinned host memory to static
device buffers in one copy each; the recurrent states at every position land in the speculator's
kept buffers (`Speculator.full_buffers`), which the graphs are captured on, so that its commit
reads them as after an eager step. Padding sequences (a bucket wider than the step) have slot -1
(their state reads touch no real slot's, their writes go nowhere), KV slot -1, and a context of
-W: no key is read for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engram.cache.forward_batch import ForwardBatch, VerifyStates
from engram.engine.scheduler import ScheduledChunk
from engram.engine.speculative import commit_layers

if TYPE_CHECKING:
    from engram.engine.runner import ModelRunner


class VerifyGraphs:
    def __init__(self, runner: ModelRunner, states: VerifyStates, width: int):
        """`states`: buffers of the widest step (its sequences' rows, W positions each)."""
        self.runner, self.states, self.width = runner, states, width
        n = states.rows.shape[0]
        self.max_batch = min(n, runner.decode_bucket(n))  # n, or the decode graphs' largest batch when smaller
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._commits: dict[int, torch.cuda.CUDAGraph] = {}
        self._static: dict[str, torch.Tensor] = {}

    def buckets(self) -> list[int]:
        """The batch buckets captured: the decode graphs' up to the speculator's largest step."""
        return sorted({min(self.runner.decode_bucket(n), self.max_batch) for n in range(1, self.max_batch + 1)})

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets() if b >= n)

    def usable(self, chunks: list[ScheduledChunk]) -> bool:
        if not chunks or len(chunks) > self.max_batch or any(c.length != self.width or c.seq.num_inflight for c in chunks):
            return False
        return not self.runner.kv_pool.needs_pages or all(len(c.seq.blocks) <= self.runner.max_pages() for c in chunks)

    def _alloc(self) -> None:
        b, w, dev = self.max_batch, self.width, self.runner.device
        t = b * w
        # int64: ids | positions | KV slots (t each), then state slots | contexts (b each)
        self._host = torch.zeros(3 * t + 2 * b, dtype=torch.int64).pin_memory()
        self._host_np = self._host.numpy()
        pages = self.runner.table_width()
        self._host_table = torch.full((b, pages), -1, dtype=torch.int32).pin_memory()
        self._host_table_np = self._host_table.numpy()
        self._host_commit = torch.zeros((3, b), dtype=torch.int64).pin_memory()  # slots, rows, fed
        self._static = {
            "commit": torch.zeros((3, b), dtype=torch.int64, device=dev),
            "packed": torch.zeros(3 * t + 2 * b, dtype=torch.int64, device=dev),
            "table": torch.full((b, pages), -1, dtype=torch.int32, device=dev),
            "cu": torch.arange(0, (b + 1) * w, w, dtype=torch.int64, device=dev),
            "logits_indices": torch.arange(t, dtype=torch.int64, device=dev),
        }

    def _batch(self, b: int) -> ForwardBatch:
        st, w, t = self._static, self.width, self.max_batch * self.width
        p, n = st["packed"], b * w
        s = self.states
        verify = s.narrowed(b, w, s.rows[:b], s.flat[:n])
        return ForwardBatch(
            input_ids=p[:n],
            positions=p[t : t + n],
            seq_lens=[w] * b,
            context_lens=[self.runner.placeholder_context()] * b,  # host placeholders: kernels read the device tensors
            state_slots=p[3 * t : 3 * t + b],
            slot_mapping=p[2 * t : 2 * t + n],
            block_tables=st["table"][:b],
            logits_indices=st["logits_indices"][:n],
            state_pool=self.runner.state_pool,
            kv_pool=self.runner.kv_pool,
            cu_seqlens=st["cu"][: b + 1],
            context_lens_t=p[3 * t + self.max_batch : 3 * t + self.max_batch + b],
            verify=verify,
        )

    def _stage_padding(self) -> None:
        """Host inputs of padding sequences only: the warm-up runs and the capture touch no state or KV."""
        h, t, b = self._host_np, self.max_batch * self.width, self.max_batch
        h[: 2 * t] = 0
        h[2 * t : 3 * t + b] = -1
        h[3 * t + b :] = -self.width

    def capture(self, b: int) -> None:
        """The verify step's graph of bucket b and its commit's (the commit's warm-up runs write a
        slot taken for them, given back after). With every slot a request's (a capture on a
        request's path), the commit's graph is left to `commit`, which captures it on its entries."""
        if b in self._graphs:
            return
        if not self._static:
            self._alloc()
        runner = self.runner
        runner.wait_pinned_inputs_read()
        self._stage_padding()
        self._static["packed"].copy_(self._host, non_blocking=True)
        batch = self._batch(b)
        self._graphs[b] = runner.record(lambda: runner.model(batch))
        runner.count_capture("verify", b)
        if b not in self._commits and runner.state_pool.num_free:
            slot = runner.state_pool.allocate()
            self._capture_commit(b, [[slot], [0], [1]])
            runner.state_pool.free(slot)

    def _stage_commit(self, b: int, entries: list[list[int]]) -> None:
        """Entries [slots, rows, fed] padded to b with copies of the first (the same state written
        twice, a write that changes nothing), copied to the device."""
        self.runner.wait_pinned_inputs_read()
        n = len(entries[0])
        host = self._host_commit.numpy()
        for i, values in enumerate(entries):
            host[i, :n] = values
            host[i, n:b] = values[0]
        self._static["commit"].copy_(self._host_commit, non_blocking=True)

    def _capture_commit(self, b: int, entries: list[list[int]]) -> None:
        """Its warm-up runs commit `entries` (so do they when captured on a request's: a commit
        run again writes the same states)."""
        self._stage_commit(b, entries)
        slots, rows, fed = self._static["commit"][:, :b].unbind(0)

        def commit() -> torch.Tensor:
            commit_layers(self.runner.state_pool, self.states, slots, rows, fed)
            return fed

        self._commits[b], _ = self.runner.record(commit)
        self.runner.count_capture("verify commit", b)

    @torch.inference_mode()
    def commit(self, entries: list[list[int]]) -> bool:
        """`CommitGraphs.commit`: a replay of the commit graph of the entries' bucket."""
        n = len(entries[0])
        if n > self.max_batch:  # a wider eager step
            return False
        b = self.bucket(n)
        if not self._static:
            self._alloc()
        if b not in self._commits:
            self._capture_commit(b, entries)
        self._stage_commit(b, entries)
        self.runner.replay_graph(self._commits[b])
        return True

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The step's logits rows, W per chunk."""
        n, w = len(chunks), self.width
        b = self.bucket(n)
        self.capture(b)
        runner = self.runner
        runner.wait_pinned_inputs_read()
        self._stage_padding()
        h, t = self._host_np, self.max_batch * w
        paged, bs = runner.kv_pool.needs_pages, runner.kv_pool.block_size
        for i, c in enumerate(chunks):
            seq = c.seq
            at = slice(i * w, (i + 1) * w)
            h[at] = c.known_tokens
            pos = np.arange(c.start, c.start + w, dtype=np.int64)
            h[t + i * w : t + (i + 1) * w] = pos
            if paged:
                blocks = np.asarray(seq.blocks, dtype=np.int64)
                h[2 * t + i * w : 2 * t + (i + 1) * w] = blocks[pos // bs] * bs + pos % bs
                self._host_table_np[i, : len(blocks)] = blocks
            h[3 * t + i] = seq.slot
            h[3 * t + self.max_batch + i] = c.start
        self._static["packed"].copy_(self._host, non_blocking=True)
        if paged:
            self._static["table"][:n].copy_(self._host_table[:n], non_blocking=True)
        graph, logits = self._graphs[b]
        runner.replay_graph(graph)
        return logits[: n * w]
