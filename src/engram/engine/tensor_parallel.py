"""Tensor parallelism's processes: rank 0 (the engine's own process) leads, ranks 1..N-1 follow.

Rank 0 runs the scheduler, the sampler and everything else of the engine. Each rank holds its
share of the weights and of every sequence's state (layers/parallel.py says which). Whatever
touches the model or the pools is one operation that every rank runs in the same order: rank 0
sends each follower the operation and its small host data (lengths, slot, KV pages) through a pipe, then
the ranks run it together over the process group (gloo on CPU, NCCL on CUDA):

- FORWARD: the step's batch (token ids, positions, state slots, KV slots, block tables, logits
  rows) broadcast as one int64 tensor; every rank runs the model, rank 0 alone makes logits (the
  LM head is whole on every rank) and samples.
- ZERO: a slot handed out is zeroed on every rank.
- WRITE_STATE / WRITE_KV: a state in the canonical (unsharded) layout is broadcast and each rank
  keeps its part: a restore.
- GATHER_STATE / GATHER_KV: every rank's part is gathered to rank 0, which puts them together in
  the canonical layout: a capture. Snapshots therefore never depend on the split.

The pipe (not a collective) carries the operation so that an idle follower waits on it with a
timeout, and leaves when rank 0's process is gone.
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
from dataclasses import dataclass
from enum import IntEnum
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engram.args import EngineArgs
from engram.cache.forward_batch import ForwardBatch
from engram.engine.pools import KVPool, StatePool
from engram.layers.parallel import Shard, TensorParallel, local_spec
from engram.models.base import CausalLM
from engram.models.loader import empty_model, load_model
from engram.models.spec import ModelSpec, load_model_spec
from engram.state.sequence_state import KVSegment, StateDtypes, recurrent_tensors

logger = logging.getLogger(__name__)

_TIMEOUT = datetime.timedelta(minutes=10)  # a collective's longest wait (all ranks reach each one within a step)
_POLL_S = 2.0  # how often an idle follower checks that rank 0 is still there


class Op(IntEnum):
    STOP = 0
    FORWARD = 1
    ZERO = 2
    WRITE_STATE = 3
    GATHER_STATE = 4
    WRITE_KV = 5
    GATHER_KV = 6
    POOLS = 7  # the pools' sizes, once rank 0 has planned its memory


def check_split(spec: ModelSpec, size: int) -> None:
    """Refuse (ConfigError naming the field) a model whose heads, groups or widths `size` ranks
    cannot share; builds rank 0's share on the meta device, which allocates nothing."""
    empty_model(spec, torch.float32, torch.device("meta"), TensorParallel(0, size))
    local_spec(spec, size)


def make_group(backend: str, store_path: str, rank: int, size: int) -> Any:
    store = dist.FileStore(store_path, size)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, size, _TIMEOUT)


@dataclass
class RankState:
    """What one rank holds: its model share and pools, and the layout that maps them to the
    canonical state (`shards[r][name]`: rank r's part of state tensor `name`)."""

    tp: TensorParallel
    device: torch.device
    model: CausalLM
    spec: ModelSpec  # the whole model's
    dtypes: StateDtypes
    shards: list[dict[str, Shard]]
    state_pool: StatePool | None = None
    kv_pool: KVPool | None = None

    # ---- the collectives, the same on every rank (rank 0 passes the data) ----

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        self.tp.group.broadcast(t, 0).wait()
        return t

    def gather(self, name: str, part: torch.Tensor, full_shape: tuple[int, ...]) -> torch.Tensor | None:
        """Every rank's `part` of state tensor `name`, assembled on rank 0 (None elsewhere)."""
        part = part.contiguous()
        parts = [[torch.empty_like(part) for _ in range(self.tp.size)]] if self.tp.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.tp.group.gather(parts, [part], opts).wait()
        if self.tp.rank:
            return None
        full = torch.empty(full_shape, dtype=part.dtype, device=part.device)
        for rank, piece in enumerate(parts[0]):
            self.shards[rank][name].place(full, piece)
        return full

    def send_batch(self, batch: ForwardBatch) -> None:
        """Rank 0's side of a forward: the batch's device tensors as one broadcast."""
        assert batch.cu_seqlens is not None and batch.context_lens_t is not None, "an eager batch carries its lengths on the device"
        parts = [
            batch.input_ids,
            batch.positions,
            batch.state_slots,
            batch.slot_mapping,
            batch.block_tables.reshape(-1),
            batch.logits_indices,
            batch.cu_seqlens,
            batch.context_lens_t,
        ]
        self.broadcast(torch.cat([p.to(torch.int64) for p in parts]))

    def run_batch(self, seq_lens: list[int], context_lens: list[int], width: int, rows: int) -> None:
        """A follower's side: the batch rebuilt from the broadcast, and its forward (no logits)."""
        assert self.state_pool is not None and self.kv_pool is not None
        t, s = sum(seq_lens), len(seq_lens)
        sizes = [t, t, s, t if self.kv_pool.needs_pages else 0, s * width, rows, s + 1, s]
        flat = self.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=self.device))
        ids, pos, slots, slot_mapping, tables, logits_rows, cu, ctx = flat.split(sizes)
        batch = ForwardBatch(
            ids, pos, seq_lens, context_lens, slots, slot_mapping, tables.view(s, width), logits_rows, self.state_pool, self.kv_pool, cu, ctx
        )
        with torch.inference_mode():
            self.model.final_hidden(batch)

    def zero(self, slot: int) -> None:
        assert self.state_pool is not None
        for t in self.state_pool.tensors.values():
            t[slot].zero_()

    def _part(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, tensors: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """Rank 0's canonical tensor `name` (from `tensors`) broadcast; this rank's part of it."""
        full = tensors[name].to(self.device, dtype).contiguous() if tensors is not None else torch.empty(shape, dtype=dtype, device=self.device)
        return self.shards[self.tp.rank][name].take(self.broadcast(full))

    def _gather_all(self, parts: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """Every tensor of `parts` gathered and assembled (on rank 0; empty elsewhere)."""
        out = {}
        for name in sorted(parts):
            full = self.gather(name, parts[name], shapes[name])
            if full is not None:
                out[name] = full
        return out

    def write_state(self, slot: int, tensors: dict[str, torch.Tensor] | None) -> None:
        assert self.state_pool is not None
        for name, (shape, dtype) in sorted(recurrent_tensors(self.spec, self.dtypes).items()):
            self.state_pool.tensors[name][slot].copy_(self._part(name, shape, dtype, tensors))

    def gather_state(self, slot: int) -> dict[str, torch.Tensor]:
        assert self.state_pool is not None
        shapes = {name: shape for name, (shape, _) in recurrent_tensors(self.spec, self.dtypes).items()}
        return self._gather_all({name: self.state_pool.tensors[name][slot] for name in shapes}, shapes)

    def _kv_shapes(self, length: int) -> dict[str, tuple[int, ...]]:
        assert self.spec.attention is not None
        shape = (length, self.spec.attention.num_kv_heads, self.spec.attention.head_dim)
        return {f"layers.{i}.{kv}": shape for i in self.spec.attention_layers for kv in ("k", "v")}

    def write_kv(self, blocks: list[int], length: int, start: int, end: int, tensors: dict[str, torch.Tensor] | None) -> None:
        """Positions start..end-1 of a sequence of `length` tokens into its pages."""
        assert self.kv_pool is not None
        parts = {name: self._part(name, shape, self.dtypes.kv, tensors) for name, shape in sorted(self._kv_shapes(end - start).items())}
        KVPool.write(self.kv_pool, blocks, length, [KVSegment(start, end, parts)])

    def gather_kv(self, blocks: list[int], length: int, start: int) -> dict[str, torch.Tensor]:
        assert self.kv_pool is not None
        return self._gather_all(KVPool.gather(self.kv_pool, blocks, length, start), self._kv_shapes(length - start))


def _run_op(state: RankState, op: Op, host: tuple[Any, ...]) -> None:
    """A follower's side of one operation (rank 0's is in `Leader`)."""
    if op == Op.FORWARD:
        state.run_batch(*host)
    elif op == Op.ZERO:
        state.zero(*host)
    elif op == Op.WRITE_STATE:
        state.write_state(host[0], None)
    elif op == Op.GATHER_STATE:
        state.gather_state(*host)
    elif op == Op.WRITE_KV:
        blocks, length, start, end = host
        state.write_kv(blocks, length, start, end, None)
    elif op == Op.GATHER_KV:
        state.gather_kv(*host)


def _device(args: EngineArgs, rank: int) -> torch.device:
    from engram.engine.engine import resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    return device


def rank_state(args: EngineArgs, spec: ModelSpec, tp: TensorParallel, device: torch.device, model: CausalLM) -> RankState:
    from engram.engine import memory_planner
    from engram.engine.engine import resolve_dtype

    dtypes = memory_planner.state_dtypes(spec, resolve_dtype(args.dtype, device), args.mamba_ssm_dtype, args.kv_cache_dtype)
    return RankState(tp, device, model, spec, dtypes, [model.state_shards(r) for r in range(tp.size)])


def _follow(rank: int, size: int, store_path: str, args: EngineArgs, conn: Connection) -> None:
    """A follower's process: load its share, allocate its pools, then run rank 0's operations."""
    from engram.engine.engine import resolve_dtype
    from engram.ops.dispatch import select_kernels, use_kernels

    device = _device(args, rank)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    tp = TensorParallel(rank, size, make_group("nccl" if device.type == "cuda" else "gloo", store_path, rank, size))
    try:
        use_kernels(select_kernels(device.type, args.enable_fast_ops))
        spec = load_model_spec(str(args.model_path))
        model = load_model(spec, str(args.model_path), resolve_dtype(args.dtype, device), device, tp)
        state = rank_state(args, spec, tp, device, model)
    except Exception as e:  # reported by rank 0, which cannot go on without this rank
        conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    op, host = conn.recv()
    if op == Op.STOP:  # rank 0 failed to start
        return
    num_slots, num_blocks = host
    shard_spec = local_spec(spec, size)
    state.state_pool = StatePool(shard_spec, num_slots, state.dtypes, device)
    state.kv_pool = KVPool(shard_spec, num_blocks, args.kv_block_size, state.dtypes.kv, device)
    parent = mp.parent_process()
    while True:
        if not conn.poll(_POLL_S):
            if parent is not None and not parent.is_alive():
                return
            continue
        try:
            op, host = conn.recv()
        except EOFError:  # rank 0's end of the pipe closed
            return
        if op == Op.STOP:
            return
        _run_op(state, Op(op), host)


class Leader:
    """Rank 0's side: starts the followers, and runs each operation on every rank."""

    def __init__(self, args: EngineArgs, spec: ModelSpec, device: torch.device):
        size = args.tensor_parallel_size
        check_split(spec, size)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs; {torch.cuda.device_count()} visible")
        self._dir = tempfile.TemporaryDirectory(prefix="engram-tp-")
        store = os.path.join(self._dir.name, "store")
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_follow, args=(rank, size, store, args, theirs), daemon=True, name=f"engram-tp{rank}")
            proc.start()
            self._conns.append(ours)
            self._procs.append(proc)
        self.tp = TensorParallel(0, size, make_group("nccl" if device.type == "cuda" else "gloo", store, 0, size))
        self.state: RankState | None = None

    def start(self, state: RankState, num_slots: int, num_blocks: int) -> None:
        """Wait for every follower's share, then have them allocate their pools."""
        errors = [msg for kind, msg in (conn.recv() for conn in self._conns) if kind == "error"]
        if errors:
            self.close()
            raise RuntimeError("tensor-parallel ranks failed to start: " + "; ".join(errors))
        for conn in self._conns:
            conn.send((int(Op.POOLS), (num_slots, num_blocks)))
        self.state = state

    def _send(self, op: Op, *host: Any) -> RankState:
        for conn in self._conns:
            conn.send((int(op), host))
        assert self.state is not None
        return self.state

    def forward(self, batch: ForwardBatch) -> None:
        width = batch.block_tables.shape[1]
        self._send(Op.FORWARD, batch.seq_lens, batch.context_lens, width, batch.logits_indices.numel()).send_batch(batch)

    def zero(self, slot: int) -> None:
        self._send(Op.ZERO, slot)

    def write_state(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        self._send(Op.WRITE_STATE, slot).write_state(slot, tensors)

    def gather_state(self, slot: int) -> dict[str, torch.Tensor]:
        return self._send(Op.GATHER_STATE, slot).gather_state(slot)

    def write_kv(self, blocks: list[int], length: int, segment: KVSegment) -> None:
        self._send(Op.WRITE_KV, blocks, length, segment.start, segment.end).write_kv(blocks, length, segment.start, segment.end, segment.tensors)

    def gather_kv(self, blocks: list[int], length: int, start: int) -> dict[str, torch.Tensor]:
        return self._send(Op.GATHER_KV, blocks, length, start).gather_kv(blocks, length, start)

    def close(self) -> None:
        """Stop the followers (idempotent)."""
        for conn in self._conns:
            try:
                conn.send((int(Op.STOP), ()))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        self._conns, self._procs = [], []
        self._dir.cleanup()


class LeaderStatePool(StatePool):
    """Rank 0's state pool: its own share, each operation run on every rank; `views` and `write`
    take and give the canonical (unsharded) tensors."""

    def __init__(self, leader: Leader, spec: ModelSpec, num_slots: int, dtypes: StateDtypes, device: torch.device):
        super().__init__(spec, num_slots, dtypes, device)
        self.leader = leader

    def allocate(self) -> int:
        slot = super().allocate()
        self.leader.zero(slot)
        return slot

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        return self.leader.gather_state(slot)

    def write(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        self.leader.write_state(slot, tensors)


class LeaderKVPool(KVPool):
    """Rank 0's KV pool: `gather` and `write` move the canonical rows (every KV head)."""

    def __init__(self, leader: Leader, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(spec, num_blocks, block_size, dtype, device)
        self.leader = leader

    def gather(self, blocks: list[int], length: int, start: int = 0) -> dict[str, torch.Tensor]:
        return self.leader.gather_kv(blocks, length, start) if self.k else {}

    def write(self, blocks: list[int], length: int, segments: list[KVSegment]) -> None:
        for segment in segments if self.k else ():
            self.leader.write_kv(blocks, length, segment)
