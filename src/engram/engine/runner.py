"""Turns scheduled chunks into one flat `ForwardBatch`, runs the model, returns logits rows.

On CUDA with graph-safe fast kernels, decode steps (every sequence feeds one token) replay a CUDA
graph captured once per batch-size bucket. The host stages a step's inputs in pinned memory, in one
of two buffers taken in turn (ops/staging.py), while the GPU still runs the step before; the
graph's first kernel reads them from there and its argmax leaves each row's token in device memory
(`sampled`) and in the same turn's row of pinned host memory. So nothing is copied, and nothing
waited for, between two replays. Padding rows carry slot -1 / context -1, so that they read and
write no state, and nothing inside the step waits for the host. Logits stay on the device.

With overlapped scheduling a step can be launched before the previous step's tokens reach the
host: a sequence whose input token is still in flight (`num_inflight`) reads it from `sampled`,
where the engine's device-side sampling left it, by its row (`inflight_row`). A decode graph takes
each row's token with one gather (from `sampled` or from the ids sent with the step). Tokens that
eager steps sample on the device go to the host on a side stream.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engram.cache.forward_batch import ForwardBatch, VerifyStates
from engram.engine.pools import KVPool, StatePool
from engram.engine.scheduler import ScheduledChunk
from engram.engine.verify_graphs import VerifyGraphs
from engram.models.base import CausalLM
from engram.ops.dispatch import kernels
from engram.ops.staging import HEADER_WORDS, TOKEN_ROW, staged_length

logger = logging.getLogger(__name__)

_GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# Prefills of one sequence (a new prompt, or a new turn on top of a kept state) also replay graphs,
# per token-count bucket up to the step's token budget; the kernels read the true length from
# device tensors. An eager prefill is bound by the host (a 512-token prompt's first token: 37 ms
# eager, 21 ms from its graph on an H200), and over HTTP prompts arrive one or two per step.
_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
_PACKED_ROWS = TOKEN_ROW + 1  # int64 rows of a decode graph's packed inputs (`_alloc_static`)


@contextmanager
def _garbage_collection_paused() -> Iterator[None]:
    """Python's cyclic collector paused: run inside a capture it could free CUDA objects (another
    engine's graphs, events), a call that invalidates the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class _Turns:
    """The host's side of a decode graph's `turn` (ops/staging.py): the parity of the next replay,
    and per parity the event that marks its last replay done."""

    done: list[torch.cuda.Event]
    parity: int = 0

    def wait(self, parity: int) -> None:
        self.done[parity].synchronize()


@dataclass
class _DecodeGraph:
    """A captured decode step whose every replay, a benchmark's too, moves the turns on."""

    graph: torch.cuda.CUDAGraph
    turns: _Turns

    def replay(self) -> None:
        self.graph.replay()
        self.turns.done[self.turns.parity].record()
        self.turns.parity ^= 1


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        state_pool: StatePool,
        kv_pool: KVPool,
        device: torch.device,
        *,
        enable_cuda_graph: bool = False,
        max_context_length: int | None = None,
        max_prefill_graph_tokens: int = _PREFILL_BUCKETS[-1],
        batch_sink: Callable[[ForwardBatch], None] | None = None,
    ):
        """`batch_sink` sees every eager batch before its forward (tensor parallelism: rank 0 sends
        it to the other ranks, which run the same forward)."""
        self.model = model
        self.batch_sink = batch_sink
        self.state_pool = state_pool
        self.kv_pool = kv_pool
        self.device = device
        self.enable_cuda_graph = enable_cuda_graph
        self.max_context_length = max_context_length
        # the buckets a prefill chunk can reach (the step's token budget), the last one whole
        self.prefill_buckets = tuple(b for b in _PREFILL_BUCKETS if b < max_prefill_graph_tokens) + (
            next((b for b in _PREFILL_BUCKETS if b >= max_prefill_graph_tokens), _PREFILL_BUCKETS[-1]),
        )
        self._graphs: dict[int, tuple[_DecodeGraph, torch.Tensor]] = {}
        self._prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pf: dict[str, torch.Tensor] = {}  # a prefill graph's static inputs, made with the first one
        self._static: dict[str, torch.Tensor] = {}  # a decode graph's, likewise
        self._graph_pool: Any = None  # torch's graph memory pool handle, shared by every graph
        self._inputs_sent: torch.cuda.Event | None = None  # marks the last prefill replay's copies out of its pinned inputs
        self.num_graph_replays = 0
        self.num_graph_captures = 0
        self.ready = False  # set by the engine when it serves: a capture from then on is logged
        # The last device-sampled step's tokens, one row per completing sequence (at most one per slot).
        self.sampled = torch.zeros(state_pool.num_slots, dtype=torch.int64, device=device)
        self.argmax_in_sampled = False  # the last run was a decode graph: `sampled` holds its rows' argmax
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._sampled_copied: torch.cuda.Event | None = None  # the last copy of `sampled` to the host
        self.verify_graphs: VerifyGraphs | None = None  # speculative verify steps in graphs (`enable_verify_graphs`)

    # ---- eager batches (prefill, mixed steps, CPU) --------------------------------------------

    def build_batch(self, chunks: list[ScheduledChunk], verify: VerifyStates | None = None) -> ForwardBatch:
        dev = self.device
        bs = self.kv_pool.block_size
        n = len(chunks)
        seq_lens = [c.length for c in chunks]
        context_lens = [c.start for c in chunks]
        total = sum(seq_lens)
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slot_mapping = np.empty(total if self.kv_pool.needs_pages else 0, dtype=np.int64)
        max_blocks = max((len(c.seq.blocks) for c in chunks), default=0)
        tables = np.full((n, max(max_blocks, 1)), -1, dtype=np.int64)
        cu = np.zeros(n + 1, dtype=np.int64)
        logits_indices = []
        feed_at, feed_rows = [], []  # input positions whose token is still in flight, and its row
        offset = 0
        for i, c in enumerate(chunks):
            end = offset + c.length
            known = c.known_tokens
            input_ids[offset : offset + len(known)] = known
            if len(known) < c.length:
                feed_at.append(end - 1)
                feed_rows.append(c.seq.inflight_row)
            pos = np.arange(c.start, c.start + c.length, dtype=np.int64)
            positions[offset:end] = pos
            if c.seq.blocks:
                blocks = np.asarray(c.seq.blocks, dtype=np.int64)
                tables[i, : len(blocks)] = blocks
                if self.kv_pool.needs_pages:
                    slot_mapping[offset:end] = blocks[pos // bs] * bs + pos % bs
            offset = end
            cu[i + 1] = offset
            rows = c.prompt_rows
            logits_indices += [end - c.length + p - c.start for p in rows]
            if c.draft or c.padding:  # a verify chunk: a logits row after each fed token
                logits_indices += range(end - c.length, end)
            elif c.completes and not (rows and rows[-1] == c.start + c.length - 1):
                logits_indices.append(end - 1)

        def put(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            if dev.type == "cuda":
                t = t.pin_memory().to(dev, non_blocking=True)
            return t.to(dev)

        input_ids_t = put(input_ids)
        if feed_at:
            input_ids_t[put(np.asarray(feed_at))] = self.sampled[put(np.asarray(feed_rows))]
        batch = ForwardBatch(
            input_ids=input_ids_t,
            positions=put(positions),
            seq_lens=seq_lens,
            context_lens=context_lens,
            state_slots=put(np.asarray([c.seq.slot for c in chunks], dtype=np.int64)),
            slot_mapping=put(slot_mapping),
            block_tables=put(tables),
            logits_indices=put(np.asarray(logits_indices, dtype=np.int64)),
            state_pool=self.state_pool,
            kv_pool=self.kv_pool,
            cu_seqlens=put(cu),
            context_lens_t=put(np.asarray(context_lens, dtype=np.int64)),
            verify=verify,
        )
        if self.batch_sink is not None:
            self.batch_sink(batch)
        return batch

    # ---- CUDA graphs for decode steps -----------------------------------------------------------

    def enable_verify_graphs(self, states: VerifyStates, width: int) -> bool:
        """Speculative verify steps of `width` tokens per sequence replay graphs captured on `states`
        (engine/verify_graphs.py), when graphs are on. Returns whether they are."""
        if self._graphs_enabled():
            self.verify_graphs = VerifyGraphs(self, states, width)
        return self.verify_graphs is not None

    @property
    def graphs_on(self) -> bool:
        return self._graphs_enabled()

    def _graphs_enabled(self) -> bool:
        return self.enable_cuda_graph and self.device.type == "cuda" and kernels().graph_safe_decode

    def _graphs_usable(self, chunks: list[ScheduledChunk]) -> bool:
        if not self._graphs_enabled():
            return False
        if not chunks or len(chunks) > self._max_graph_batch():
            return False
        if not all(c.length == 1 and c.start > 0 and c.completes for c in chunks):
            return False
        max_pages = self.max_pages()
        return all(len(c.seq.blocks) <= max_pages for c in chunks)

    def _max_graph_batch(self) -> int:
        return min(self.state_pool.num_slots, _GRAPH_BUCKETS[-1])

    def max_pages(self) -> int:
        if not self.kv_pool.needs_pages:
            return 1 << 62
        ctx = self.max_context_length or self.kv_pool.num_blocks * self.kv_pool.block_size
        return min(self.kv_pool.num_blocks, -(-ctx // self.kv_pool.block_size))

    def decode_bucket(self, n: int) -> int:
        """The decode graph of a batch of n sequences."""
        for b in _GRAPH_BUCKETS:
            if b >= n and b <= self._max_graph_batch():
                return b
        return self._max_graph_batch()

    def table_width(self) -> int:
        """Block-table columns of the decode graphs' inputs."""
        return self.max_pages() if self.kv_pool.needs_pages else 1

    def _alloc_static(self) -> None:
        bmax = self._max_graph_batch()
        width = self.table_width()
        dev = self.device
        # A step's inputs: six int64 rows (input_ids, positions, slots, slot_mapping, context, each
        # row's token in `sampled` or -1), then the block tables (int32, column-major). The host
        # stages them in two pinned buffers, in turn (ops/staging.py).
        self._packed_words = rows_end = 2 * _PACKED_ROWS * bmax  # int32 words of the int64 rows
        tables_end = rows_end + width * bmax
        words = tables_end + tables_end % 2  # even: the second buffer's int64s aligned
        self._staged = torch.zeros((2, HEADER_WORDS + words), dtype=torch.int32).pin_memory()
        self._staged_views = [
            (
                staged_length(self._staged, p).numpy(),
                staged[:rows_end].view(torch.int64).view(_PACKED_ROWS, bmax).numpy(),
                staged[rows_end:tables_end].view(width, bmax).numpy(),
            )
            for p, staged in enumerate(self._staged[:, HEADER_WORDS:])
        ]
        self._host_tokens = torch.zeros((2, bmax), dtype=torch.int64).pin_memory()
        self._turn = torch.zeros(3, dtype=torch.int64, device=dev)
        self._turns = _Turns([torch.cuda.Event(), torch.cuda.Event()])
        inputs = torch.zeros(words, dtype=torch.int32, device=dev)
        self._static = {
            "inputs": inputs,
            "packed": inputs[:rows_end].view(torch.int64).view(_PACKED_ROWS, bmax),
            "tables_t": inputs[rows_end:tables_end].view(width, bmax),
            "input_ids": torch.zeros(bmax, dtype=torch.int64, device=dev),
            "cu": torch.arange(bmax + 1, dtype=torch.int64, device=dev),
            "logits_indices": torch.arange(bmax, dtype=torch.int64, device=dev),
        }
        self._graph_pool = torch.cuda.graph_pool_handle()

    def _graph_batch(self, b: int) -> ForwardBatch:
        st = self._static
        packed = st["packed"]
        return ForwardBatch(
            input_ids=st["input_ids"][:b],
            positions=packed[1, :b],
            seq_lens=[1] * b,
            context_lens=[1] * b,  # host placeholders: a decode step; kernels read the device tensors
            state_slots=packed[2, :b],
            slot_mapping=packed[3, :b],
            block_tables=st["tables_t"][:, :b].t(),  # [b, width], column-major
            logits_indices=st["logits_indices"][:b],
            state_pool=self.state_pool,
            kv_pool=self.kv_pool,
            cu_seqlens=st["cu"][: b + 1],
            context_lens_t=packed[4, :b],
        )

    @staticmethod
    def _clear_rows(rows: np.ndarray, b: int) -> None:
        """Columns :b of staged rows as padding: token and position 0, no slot, the token sent."""
        rows[0:2, :b] = 0
        rows[2:, :b] = -1

    def _stage_padding(self) -> None:
        """Both staged buffers: padding rows only, no tables."""
        for length, rows, _ in self._staged_views:
            self._clear_rows(rows, rows.shape[1])
            length[0] = self._packed_words

    def _decode_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """A graph-captured decode step: the staged inputs taken, each row's input token gathered
        from `sampled` (in flight) or the sent ids, and each row's argmax left in `sampled` and in
        the host's row of this turn."""
        b = batch.input_ids.shape[0]
        ops = kernels()
        ops.take_decode_inputs(self._staged, self._static["inputs"], self._turn, self.sampled, batch.input_ids, self._max_graph_batch())
        logits = self.model(batch)
        ops.argmax(logits, out=self.sampled[:b], host_out=self._host_tokens, turn=self._turn)
        return logits

    def record(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream, then capture one call of `forward` (on static buffers) as a graph."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with _garbage_collection_paused(), torch.cuda.graph(graph, pool=self._graph_pool, stream=stream):
            logits = forward()
        torch.cuda.synchronize(self.device)  # the pinned input buffers are refilled right after
        return graph, logits

    def _capture(self, b: int) -> None:
        if not self._static:
            self._alloc_static()
        turns = self._turns
        turns.wait(0)  # the replays so far are done with the staged buffers and the host's tokens
        turns.wait(1)
        self._wait_sampled_copied()
        self._stage_padding()  # padding rows only: the warm-up and capture touch no state
        batch = self._graph_batch(b)
        # the warm-up's argmax overwrites tokens still to be read: this step's input, the host's last
        in_flight, host_tokens = self.sampled.clone(), self._host_tokens.clone()
        graph, logits = self.record(lambda: self._decode_forward(batch))
        self._graphs[b] = (_DecodeGraph(graph, turns), logits)
        self.count_capture("decode", b)
        self._turn[0] = turns.parity  # the warm-ups took turns too
        self.sampled.copy_(in_flight)
        self._host_tokens.copy_(host_tokens)

    def _run_graph(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        n = len(chunks)
        b = self.decode_bucket(n)
        if b not in self._graphs:
            self._capture(b)
        parity = self._turns.parity
        self._turns.wait(parity)  # the replay before last has read this buffer
        length, h, tables = self._staged_views[parity]
        self._clear_rows(h, b)
        seqs = [c.seq for c in chunks]
        positions = [c.start for c in chunks]
        h[1, :n] = h[4, :n] = positions
        h[2, :n] = [seq.slot for seq in seqs]
        for i, (seq, pos) in enumerate(zip(seqs, positions)):
            if pos < len(seq.token_ids):
                h[0, i] = seq.token_ids[pos]
            else:
                h[TOKEN_ROW, i] = seq.inflight_row
        paged = self.kv_pool.needs_pages
        width = 1
        if paged:
            bs = self.kv_pool.block_size
            h[3, :n] = [seq.blocks[pos // bs] * bs + pos % bs for seq, pos in zip(seqs, positions)]
            for i, seq in enumerate(seqs):
                tables[: len(seq.blocks), i] = seq.blocks
            width = max(len(seq.blocks) for seq in seqs)
        length[0] = self._packed_words + (width * tables.shape[1] if paged else 0)
        graph, logits = self._graphs[b]
        self._wait_sampled_copied()  # the graph's argmax writes `sampled`
        graph.replay()
        self.num_graph_replays += 1
        return logits[:n]

    # ---- CUDA graphs for short single-sequence prefills -------------------------------------------

    def _prefill_graph_usable(self, chunks: list[ScheduledChunk]) -> bool:
        if not self._graphs_enabled():
            return False
        if len(chunks) != 1:
            return False
        c = chunks[0]
        if not c.completes or c.length > self.prefill_buckets[-1] or (c.length == 1 and c.start > 0) or c.seq.num_inflight:
            return False
        return not self.kv_pool.needs_pages or len(c.seq.blocks) <= self.max_pages()

    def _alloc_prefill_static(self) -> None:
        tmax = self.prefill_buckets[-1]
        width = self.table_width()
        dev = self.device
        n = 3 * tmax + 5  # ids | positions | slot mapping | slot, cu[0], cu[1], context, logits row
        self._pf_host = torch.zeros(n, dtype=torch.int64).pin_memory()
        self._pf_host_np = self._pf_host.numpy()
        self._pf_host_table = torch.zeros(width, dtype=torch.int32).pin_memory()
        self._pf_host_table_np = self._pf_host_table.numpy()
        self._pf = {"packed": torch.zeros(n, dtype=torch.int64, device=dev), "table": torch.zeros((1, width), dtype=torch.int32, device=dev)}
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()

    def _prefill_batch(self, tb: int) -> ForwardBatch:
        tmax = self.prefill_buckets[-1]
        p = self._pf["packed"]
        o = 3 * tmax
        placeholder_ctx = self.placeholder_context()
        return ForwardBatch(
            input_ids=p[:tb],
            positions=p[tmax : tmax + tb],
            seq_lens=[tb],
            context_lens=[placeholder_ctx],
            state_slots=p[o : o + 1],
            slot_mapping=p[2 * tmax : 2 * tmax + tb],
            block_tables=self._pf["table"],
            logits_indices=p[o + 4 : o + 5],
            state_pool=self.state_pool,
            kv_pool=self.kv_pool,
            cu_seqlens=p[o + 1 : o + 3],
            context_lens_t=p[o + 3 : o + 4],
        )

    def placeholder_context(self) -> int:
        """The host's context length of a captured step of several tokens per sequence: a long one,
        so that every choice made on the host (grids, key splits) covers any real context."""
        return max(self.max_pages() * self.kv_pool.block_size if self.kv_pool.needs_pages else 0, 1 << 16)

    def _capture_prefill(self, tb: int) -> None:
        if not self._pf:
            self._alloc_prefill_static()
        h = self._pf_host_np
        h[:] = 0
        tmax = self.prefill_buckets[-1]
        h[2 * tmax : 3 * tmax] = -1
        h[3 * tmax] = -1  # no slot: the warm-up and capture touch no state (and cu = [0, 0])
        self._pf["packed"].copy_(self._pf_host, non_blocking=True)
        batch = self._prefill_batch(tb)
        self._prefill_graphs[tb] = self.record(lambda: self.model(batch))
        self.count_capture("prefill", tb)

    def count_capture(self, kind: str, size: int) -> None:
        self.num_graph_captures += 1
        if self.ready:  # on a request's path: say which
            logger.warning("CUDA graph captured after ready: %s bucket %d", kind, size)

    def capturable_buckets(self) -> list[tuple[str, int]]:
        """Every graph a run could capture with graphs on, ("decode", batch), ("prefill", tokens) and,
        with speculation, ("verify", batch): the largest batch is a bucket of its own when it falls
        between two."""
        decode = sorted({b for b in _GRAPH_BUCKETS if b <= self._max_graph_batch()} | {self._max_graph_batch()})
        verify = self.verify_graphs.buckets() if self.verify_graphs is not None else []
        return [("decode", b) for b in decode] + [("prefill", tb) for tb in self.prefill_buckets] + [("verify", b) for b in verify]

    def prefill_bucket(self, n: int) -> int:
        """The prefill graph of a single-sequence prefill of n tokens (at most the last bucket)."""
        return next(b for b in self.prefill_buckets if b >= n)

    @torch.inference_mode()
    def capture(self, kind: str, size: int) -> None:
        """Capture one graph of `capturable_buckets` now (at start-up, so that no request waits for it)."""
        if kind == "decode" and size not in self._graphs:
            self._capture(size)
        elif kind == "prefill" and size not in self._prefill_graphs:
            self._capture_prefill(size)
        elif kind == "verify" and self.verify_graphs is not None:
            self.verify_graphs.capture(size)

    def wait_pinned_inputs_read(self) -> None:
        """Before refilling a prefill graph's pinned inputs: with overlapped steps the host can come
        back here before the GPU has run the last replay's copy out of them."""
        if self._inputs_sent is not None:
            self._inputs_sent.synchronize()

    def replay_graph(self, graph: torch.cuda.CUDAGraph) -> None:
        """Replay a prefill graph after its input copies were queued, marking when those are done."""
        if self._inputs_sent is None:
            self._inputs_sent = torch.cuda.Event()
        self._inputs_sent.record()
        graph.replay()
        self.num_graph_replays += 1

    def _run_prefill_graph(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        self.wait_pinned_inputs_read()
        c = chunks[0]
        n = c.length
        tb = self.prefill_bucket(n)
        if tb not in self._prefill_graphs:
            self._capture_prefill(tb)
        tmax = self.prefill_buckets[-1]
        h = self._pf_host_np
        seq = c.seq
        pos = np.arange(c.start, c.start + n, dtype=np.int64)
        h[:tb] = 0
        h[:n] = seq.token_ids[c.start : c.start + n]
        h[tmax : tmax + n] = pos
        h[2 * tmax : 2 * tmax + tb] = -1
        if self.kv_pool.needs_pages:
            bs = self.kv_pool.block_size
            blocks = np.asarray(seq.blocks, dtype=np.int64)
            h[2 * tmax : 2 * tmax + n] = blocks[pos // bs] * bs + pos % bs
            self._pf_host_table_np[: len(blocks)] = blocks
        o = 3 * tmax
        h[o : o + 5] = (seq.slot, 0, n, c.start, n - 1)
        self._pf["packed"].copy_(self._pf_host, non_blocking=True)
        if self.kv_pool.needs_pages:
            nb = len(seq.blocks)
            self._pf["table"][0, :nb].copy_(self._pf_host_table[:nb], non_blocking=True)
        graph, logits = self._prefill_graphs[tb]
        self.replay_graph(graph)
        return logits

    # ---- the sampled tokens' way to the host ------------------------------------------------------

    def copy_sampled_to_host(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The first n rows of `sampled` on the host, and (on CUDA) the event that marks them there.
        The copy runs on a side stream, beside the next step's input copy: whatever writes `sampled`
        next waits for it first (`_wait_sampled_copied`)."""
        if self._copy_stream is None:
            return self.sampled[:n].clone(), None
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            tokens = self.sampled[:n].to("cpu", non_blocking=True)
            self._sampled_copied = torch.cuda.Event()
            self._sampled_copied.record()
        return tokens, self._sampled_copied

    def argmax_on_host(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The last decode replay's argmax, rows :n, in pinned host memory, and the event that marks
        them there. Valid until the replay after next (which writes the same row)."""
        parity = self._turns.parity ^ 1
        return self._host_tokens[parity, :n], self._turns.done[parity]

    def writable_sampled(self, n: int) -> torch.Tensor:
        """The first n rows of `sampled`, for the current stream to write once their last copy is done."""
        self._wait_sampled_copied()
        return self.sampled[:n]

    def _wait_sampled_copied(self) -> None:
        """Before `sampled` is written again: the current stream waits for its last copy to the host."""
        if self._sampled_copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._sampled_copied)
            self._sampled_copied = None

    # ---- entry point ---------------------------------------------------------------------------

    @torch.inference_mode()
    def run_with_prompt_rows(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """`run` for a step in which some chunks ask for the last hidden states of their
        `prompt_rows` (always eager): the logits, and per chunk those hidden states (None: none)."""
        self.argmax_in_sampled = False
        hidden = self.model.final_hidden(self.build_batch(chunks))
        sample: list[int] = []
        per_chunk: list[torch.Tensor | None] = []
        at = 0
        for c in chunks:
            rows = c.prompt_rows
            per_chunk.append(hidden[at : at + len(rows)] if rows else None)
            at += len(rows)
            if c.completes and not (rows and rows[-1] == c.start + c.length - 1):
                at += 1
            if c.completes:
                sample.append(at - 1)
        return self.model.compute_logits(hidden[sample]), per_chunk

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], verify: VerifyStates | None = None) -> torch.Tensor:
        """Logits [number of completing chunks, vocab] (as the model returns them, on its device), valid until
        the next call (graph replays reuse their output buffers). A speculative step (`verify`: its
        recurrent states by position) has a row after every fed token of a verify chunk; it replays a
        verify graph when the chunks have the graphs' width (`enable_verify_graphs`), else runs eagerly."""
        if verify is not None:
            self.argmax_in_sampled = False
            if self.verify_graphs is not None and self._graphs_enabled() and self.verify_graphs.usable(chunks):
                return self.verify_graphs.run(chunks)
            return self.model(self.build_batch(chunks, verify))
        self.argmax_in_sampled = self._graphs_usable(chunks)
        if self.argmax_in_sampled:
            return self._run_graph(chunks)
        if self._prefill_graph_usable(chunks):
            return self._run_prefill_graph(chunks)
        return self.model(self.build_batch(chunks))
