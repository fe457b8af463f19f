"""Gated DeltaNet mixer (Qwen3-Next, Qwen3.5) over a flat batch, its state in the StatePool by slot.

One input projection yields [q | k | v | z | b | a]: q, k and v first, so that at decode the
causal conv update of those columns rides on the projection (`linear_conv_update`, as Mamba2's).
Checkpoints hold the projection in parts (`packed_parts`): Qwen3.5's in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a as row ranges; Qwen3-Next's in_proj_qkvz and in_proj_ba grouped by q/k head,
scattered to their rows here.

Under tensor parallelism a rank keeps an equal part of the q/k heads and the value heads grouped
over them: their rows of every projection part, their conv channels and state, and the columns of
out_proj (row-parallel, then an all-reduce). The per-head norm is whole on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers import parallel
from engram.layers.linear import Linear
from engram.layers.parallel import Range, Shard, even
from engram.models.spec import GatedDeltaNetSpec
from engram.ops.dispatch import kernels


def project_and_convolve(
    hidden: torch.Tensor, in_proj: Linear, conv1d: nn.Conv1d, sizes: list[int], batch: ForwardBatch, layer_index: int
) -> list[torch.Tensor]:
    """The input projection's parts (`sizes`), the first (q, k and v) through the causal conv with
    SiLU from the slot's window `layers.<i>.conv`; at decode the conv update rides on the projection."""
    k, conv_pool, slots = kernels(), batch.state_pool.of(layer_index, "conv"), batch.state_slots
    weight = conv1d.weight[:, 0, :]
    if batch.is_decode:
        return list(k.linear_conv_update(hidden, in_proj.weight, None, weight, None, conv_pool, slots, 0).split(sizes, dim=-1))
    qkv, *rest = in_proj(hidden).split(sizes, dim=-1)
    if (verify := batch.verify) is not None:  # a speculative step: every position's window kept, the pool left as it is
        return [k.causal_conv1d_verify(qkv, weight, None, conv_pool, slots, verify.rows, verify.flat, verify.windows[layer_index, "conv"]), *rest]
    return [k.causal_conv1d_varlen(qkv, weight, None, conv_pool, slots, batch.seq_lens, batch.cu_seqlens), *rest]


def delta_rule(
    q: torch.Tensor, key: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch, layer_index: int, chunk_size: int
) -> torch.Tensor:
    """The gated delta rule (q and k L2-normed) from and into the slots' states `layers.<i>.recurrent`:
    one token each at decode, every position's state kept aside in a verify step, chunked varlen
    prefill otherwise. Returns o (float32)."""
    k, pool, slots = kernels(), batch.state_pool.of(layer_index, "recurrent"), batch.state_slots
    if batch.is_decode:
        return k.gated_delta_state_update(pool, slots, q, key, v, g, beta, True)
    if (verify := batch.verify) is not None:  # every position's state kept (ops/verify.py), the pool left as it is
        return k.gated_delta_verify(q, key, v, g, beta, verify.rows, verify.flat, pool, slots, verify.states[layer_index, "recurrent"], True)
    return k.gated_delta_varlen(q, key, v, g, beta, batch.seq_lens, pool, slots, chunk_size, True, None, batch.cu_seqlens)


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: GatedDeltaNetSpec, hidden_size: int, layer_index: int):
        super().__init__()
        self.tp = parallel.current()
        self.full_spec = spec
        spec = parallel.local_gated_deltanet(spec, self.tp.size) if self.tp is not None else spec
        self.spec = spec
        self.layer_index = layer_index
        self.sizes = [spec.conv_dim, spec.value_dim, spec.num_v_heads, spec.num_v_heads]  # qkv, z, b, a
        self.in_proj = Linear(hidden_size, spec.in_proj_size, bias=False)
        self.conv1d = nn.Conv1d(spec.conv_dim, spec.conv_dim, spec.conv_kernel, groups=spec.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(spec.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(spec.num_v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(spec.head_v_dim))
        self.out_proj = Linear(spec.value_dim, hidden_size, bias=False)

    def packed_parts(self) -> dict[str, tuple[str, slice | torch.Tensor]]:
        """Checkpoint parameter (relative name) -> (this module's parameter, its rows)."""
        s = self.spec
        starts = torch.tensor([0, *self.sizes]).cumsum(0).tolist()
        parts: dict[str, tuple[str, slice | torch.Tensor]] = {
            f"{name}.weight": ("in_proj.weight", slice(starts[i], starts[i + 1]))
            for i, name in enumerate(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
        }
        # Qwen3-Next: per q/k head h, [q_h, k_h, v and z of its value heads], and [b, a of its value heads]
        group = s.num_v_heads // s.num_k_heads
        rows = torch.arange(sum(self.sizes))
        q, k, v, z, b, a = rows.split([s.key_dim, s.key_dim, s.value_dim, s.value_dim, s.num_v_heads, s.num_v_heads])
        per_head = (q.view(s.num_k_heads, -1), k.view(s.num_k_heads, -1), v.view(s.num_k_heads, -1), z.view(s.num_k_heads, -1))
        parts["in_proj_qkvz.weight"] = ("in_proj.weight", torch.cat(per_head, dim=1).flatten())
        parts["in_proj_ba.weight"] = ("in_proj.weight", torch.cat((b.view(-1, group), a.view(-1, group)), dim=1).flatten())
        return parts

    def _ranges(self, rank: int) -> dict[str, tuple[Range, ...]]:
        """Rank `rank`'s entries in the full mixer's layout: its value heads, value channels, q, k
        and v channels of the conv's [q | k | v], and its rows of Qwen3-Next's per-q/k-head packed
        in_proj_qkvz and in_proj_ba."""
        assert self.tp is not None
        s, size = self.full_spec, self.tp.size
        qkv = (even(s.key_dim, rank, size), even(s.key_dim, rank, size, s.key_dim), even(s.value_dim, rank, size, 2 * s.key_dim))
        return {
            "heads": (even(s.num_v_heads, rank, size),),
            "v": (even(s.value_dim, rank, size),),
            "qkv": qkv,
            "qkvz": (even(s.conv_dim + s.value_dim, rank, size),),
            "ba": (even(2 * s.num_v_heads, rank, size),),
        }

    def tp_shards(self) -> dict[str, Shard]:
        """This rank's part of each checkpoint tensor (either layout's in_proj parts)."""
        assert self.tp is not None
        rank, r = self.tp.rank, self._ranges(self.tp.rank)
        heads = Shard(-1, r["heads"])
        return {
            **parallel.linear_shards(rank, r["qkv"], column=("in_proj_qkv",)),
            **parallel.linear_shards(rank, r["v"], column=("in_proj_z",), row=("out_proj",), out_features=self.out_proj.out_features),
            **parallel.linear_shards(rank, r["heads"], column=("in_proj_b", "in_proj_a")),
            **parallel.linear_shards(rank, r["qkvz"], column=("in_proj_qkvz",)),
            **parallel.linear_shards(rank, r["ba"], column=("in_proj_ba",)),
            "conv1d.weight": Shard(-3, r["qkv"]),
            "dt_bias": heads,
            "A_log": heads,
        }

    def state_shards(self, rank: int) -> dict[str, Shard]:
        """Rank `rank`'s part of this layer's conv state [K-1, q|k|v] and recurrent state [v heads, ...]."""
        r = self._ranges(rank)
        return {f"layers.{self.layer_index}.conv": Shard(-1, r["qkv"]), f"layers.{self.layer_index}.recurrent": Shard(-3, r["heads"])}

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s, k = self.spec, kernels()
        qkv, z, b, a = project_and_convolve(hidden, self.in_proj, self.conv1d, self.sizes, batch, self.layer_index)
        q, key, v = qkv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q, key = q.reshape(-1, s.num_k_heads, s.head_k_dim), key.reshape(-1, s.num_k_heads, s.head_k_dim)
        v = v.reshape(-1, s.num_v_heads, s.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = delta_rule(q, key, v, g, beta, batch, self.layer_index, s.chunk_size)
        # each head's values normalized, then gated (Falcon-H1's norm-before-gate with one head a group)
        o = k.norm_then_gate(
            o.to(hidden.dtype).reshape(-1, s.head_v_dim), z.reshape(-1, s.head_v_dim), self.norm.weight, s.norm_eps, s.head_v_dim, hidden.dtype
        )
        out = self.out_proj(o.reshape(-1, s.value_dim))
        return out if self.tp is None else self.tp.all_reduce(out)
