"""Tensor parallelism as the layers see it: which rank of how many, the all-reduce after a
row-parallel projection, and which slice of a full (canonical) tensor a rank holds.

A layer built while `building(tp)` is active keeps only its rank's share of heads, groups and
intermediate channels; it says which slice of each checkpoint tensor it takes (`tp_shards`) and,
for a recurrent or attention mixer, which slice of each per-sequence state tensor it keeps
(`state_shards`). The process group itself is opaque here (gloo on CPU, NCCL on CUDA): the engine
makes it (engine/tensor_parallel.py); layers only all-reduce through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from engram.models.spec import AttentionSpec, ConfigError, GatedDeltaNetSpec, MambaSpec, ModelSpec

Range = tuple[int, int]  # [start, stop) along a shard's dimension


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group; `group` is a torch.distributed backend
    object (`ProcessGroupGloo` / `ProcessGroupNCCL`) whose collectives are called directly."""

    rank: int
    size: int
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place (the partial outputs of a row-parallel layer)."""
        x = x.contiguous()
        self.group.allreduce([x]).wait()
        return x


_building: TensorParallel | None = None


@contextmanager
def building(tp: TensorParallel | None) -> Iterator[None]:
    """Layers constructed inside keep rank `tp.rank`'s share (nothing changes with None)."""
    global _building
    before, _building = _building, tp if tp is not None and tp.size > 1 else None
    try:
        yield
    finally:
        _building = before


def current() -> TensorParallel | None:
    """The group the layer being built belongs to; None without tensor parallelism."""
    return _building


def split(total: int, what: str, size: int) -> int:
    """`total` / `size`, refused with the field's name when it does not divide."""
    if total % size:
        raise ConfigError(f"{what} = {total} is not divisible by --tensor-parallel-size {size}")
    return total // size


def even(width: int, rank: int, size: int, offset: int = 0) -> Range:
    """Rank `rank`'s equal part of `width` consecutive entries starting at `offset`."""
    part = width // size
    return (offset + rank * part, offset + (rank + 1) * part)


@dataclass(frozen=True)
class Shard:
    """The part of a full tensor one rank holds: the entries `ranges` along `dim` (counted from the
    end, so that a stacked [experts, ...] tensor and one expert's share the rule), concatenated.
    `zero`: the rank holds zeros (a row-parallel projection's bias, added on rank 0 only)."""

    dim: int
    ranges: tuple[Range, ...]
    zero: bool = False

    def _index(self, ndim: int, r: Range) -> tuple[slice, ...]:
        return (slice(None),) * (ndim + self.dim) + (slice(*r),)

    def take(self, full: Any) -> torch.Tensor:
        """This rank's part of `full`: a tensor, or a safetensors slice (then only it is read)."""
        ndim = full.dim() if isinstance(full, torch.Tensor) else len(full.get_shape())
        parts = [full[self._index(ndim, r)] for r in self.ranges]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
        return torch.zeros_like(out) if self.zero else out

    def place(self, full: torch.Tensor, part: torch.Tensor) -> None:
        """Write a rank's `part` back into the full tensor (the inverse of `take`)."""
        at = 0
        for r in self.ranges:
            width = r[1] - r[0]
            full[self._index(full.dim(), r)] = part.narrow(self.dim, at, width)
            at += width


def column(width: int, rank: int, size: int) -> Shard:
    """A column-parallel projection's output rows (or its bias): an equal part each."""
    return Shard(-1, (even(width, rank, size),))


def local_mamba(spec: MambaSpec, size: int) -> MambaSpec:
    """One rank's Mamba2 mixer: its heads and groups (every rank's heads stay within its groups)."""
    return dataclasses.replace(
        spec,
        num_heads=split(spec.num_heads, "mamba num_heads", size),
        n_groups=split(spec.n_groups, "mamba n_groups", size),
    )


def local_gated_deltanet(spec: GatedDeltaNetSpec, size: int) -> GatedDeltaNetSpec:
    """One rank's gated DeltaNet: its q/k heads and the value heads grouped over them (as many
    value heads per q/k head as the full mixer has, so each value head keeps its q/k head)."""
    return dataclasses.replace(
        spec,
        num_k_heads=split(spec.num_k_heads, "linear_num_key_heads", size),
        num_v_heads=split(spec.num_v_heads, "linear_num_value_heads", size),
    )


def local_attention(spec: AttentionSpec, size: int) -> AttentionSpec:
    """One rank's attention: its query heads; KV heads split, or one each (replicated) when fewer
    than the ranks."""
    kv = spec.num_kv_heads
    if kv < size and size % kv:
        raise ConfigError(f"num_key_value_heads = {kv} neither divides nor is divisible by --tensor-parallel-size {size}")
    local_kv = split(kv, "num_key_value_heads", size) if kv >= size else 1
    return dataclasses.replace(spec, num_heads=split(spec.num_heads, "num_attention_heads", size), num_kv_heads=local_kv)


def kv_heads_of(spec: AttentionSpec, rank: int, size: int) -> Range:
    """The KV heads rank `rank` holds, in the full model's head order."""
    if spec.num_kv_heads >= size:
        return even(spec.num_kv_heads, rank, size)
    head = rank * spec.num_kv_heads // size
    return (head, head + 1)


def local_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The spec of one rank's share: the shapes its state and KV pools hold."""
    if size == 1:
        return spec
    return dataclasses.replace(
        spec,
        mamba=local_mamba(spec.mamba, size) if spec.mamba is not None else None,
        gated_deltanet=local_gated_deltanet(spec.gated_deltanet, size) if spec.gated_deltanet is not None else None,
        attention=local_attention(spec.attention, size) if spec.attention is not None else None,
    )


def linear_shards(
    rank: int, inner: tuple[Range, ...], column: tuple[str, ...] = (), row: tuple[str, ...] = (), out_features: int = 0
) -> dict[str, Shard]:
    """Checkpoint shards of `Linear` modules by name: column-parallel ones keep the output rows
    `inner` (weight and bias), row-parallel ones the input columns `inner`, their bias (of
    `out_features`) on rank 0 only, as the partial outputs are summed."""
    shards = {}
    for name in column:
        shards[f"{name}.weight"], shards[f"{name}.bias"] = Shard(-2, inner), Shard(-1, inner)
    for name in row:
        shards[f"{name}.weight"] = Shard(-1, inner)
        shards[f"{name}.bias"] = Shard(-1, ((0, out_features),), zero=rank != 0)
    return shards
