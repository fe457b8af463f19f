"""Multi-head attention with GQA over the paged KV cache; optionally (Qwen3-Next, Qwen3.5) a sigmoid
output gate from q_proj's second half of each head, and RMS norms of q and k per head (zero-centered
as Qwen's, or plain as LFM2's)."""

from __future__ import annotations

import torch
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers import parallel
from engram.layers.linear import Linear
from engram.layers.norm import RMSNorm, ZeroCenteredRMSNorm
from engram.layers.parallel import Shard, even
from engram.models.spec import AttentionSpec
from engram.ops.dispatch import kernels
from engram.ops.rotary import apply_rotary, rotary_cos_sin


def paged_attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: ForwardBatch, layer_index: int, scaling: float) -> torch.Tensor:
    """Store this step's keys and values in the layer's paged cache, then attend each new token's
    queries over its sequence's cached context. Returns [T, heads, head_dim]."""
    k = kernels()
    k_cache, v_cache = batch.kv_pool.k[layer_index], batch.kv_pool.v[layer_index]
    k.store_kv(k_cache, v_cache, key, value, batch.slot_mapping)
    return k.paged_attention(
        q,
        k_cache,
        v_cache,
        batch.seq_lens,
        batch.context_lens,
        batch.block_tables,
        batch.kv_pool.block_size,
        scaling,
        batch.cu_seqlens,
        batch.context_lens_t,
    )


class Attention(nn.Module):
    def __init__(self, spec: AttentionSpec, hidden_size: int, layer_index: int):
        super().__init__()
        self.tp = parallel.current()
        self.full_spec = spec
        spec = parallel.local_attention(spec, self.tp.size) if self.tp is not None else spec
        self.spec = spec
        self.layer_index = layer_index
        q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_sizes = [q_dim * (2 if spec.output_gate else 1), kv_dim, kv_dim]
        # q, k and v in one projection (one launch at decode); the checkpoint's q_proj, k_proj and
        # v_proj are loaded into its rows (`packed_parts`).
        self.qkv_proj = Linear(hidden_size, sum(self.qkv_sizes), bias=spec.bias)
        self.o_proj = Linear(q_dim, hidden_size, bias=spec.bias)
        if spec.qk_norm:
            norm = ZeroCenteredRMSNorm if spec.qk_norm_zero_centered else RMSNorm
            self.q_norm = norm(spec.head_dim, spec.norm_eps)
            self.k_norm = norm(spec.head_dim, spec.norm_eps)

    def packed_parts(self) -> dict[str, tuple[str, slice]]:
        """Checkpoint parameter (relative name) -> (this module's parameter, its rows)."""
        parts, start = {}, 0
        for name, size in zip(("q_proj", "k_proj", "v_proj"), self.qkv_sizes):
            rows = slice(start, start + size)
            parts[f"{name}.weight"] = ("qkv_proj.weight", rows)
            if self.spec.bias:
                parts[f"{name}.bias"] = ("qkv_proj.bias", rows)
            start += size
        return parts

    def tp_shards(self) -> dict[str, Shard]:
        """This rank's query heads of q_proj (each head's q and output gate, when gated) and o_proj,
        its KV heads of k_proj and v_proj."""
        assert self.tp is not None
        s, rank, size = self.full_spec, self.tp.rank, self.tp.size
        q = (even(s.num_heads * s.head_dim, rank, size),)
        q_rows = (even(s.num_heads * s.head_dim * (2 if s.output_gate else 1), rank, size),)
        first, last = parallel.kv_heads_of(s, rank, size)
        kv = ((first * s.head_dim, last * s.head_dim),)
        return {
            **parallel.linear_shards(rank, q_rows, column=("q_proj",)),
            **parallel.linear_shards(rank, q, row=("o_proj",), out_features=self.o_proj.out_features),
            **parallel.linear_shards(rank, kv, column=("k_proj", "v_proj")),
        }

    def state_shards(self, rank: int) -> dict[str, Shard]:
        """Rank `rank`'s KV heads of this layer's cache rows [tokens, kv_heads, head_dim]."""
        assert self.tp is not None
        heads = Shard(-2, (parallel.kv_heads_of(self.full_spec, rank, self.tp.size),))
        return {f"layers.{self.layer_index}.k": heads, f"layers.{self.layer_index}.v": heads}

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s = self.spec
        q, key, value = self.qkv_proj(hidden).split(self.qkv_sizes, dim=-1)
        gate = None
        if s.output_gate:  # each head's q, then its gate
            q, gate = q.reshape(-1, s.num_heads, 2 * s.head_dim).chunk(2, dim=-1)
        q = q.reshape(-1, s.num_heads, s.head_dim)
        key = key.view(-1, s.num_kv_heads, s.head_dim)
        value = value.view(-1, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q, key = self.q_norm(q), self.k_norm(key)
        if s.rotary_dim:
            cos, sin = rotary_cos_sin(batch.positions, s.rotary_dim, s.rope_theta, q.dtype)
            q, key = apply_rotary(q, cos, sin), apply_rotary(key, cos, sin)
        out = paged_attend(q, key, value, batch, self.layer_index, s.scaling).reshape(-1, s.num_heads * s.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(out.shape))
        out = self.o_proj(out)
        return out if self.tp is None else self.tp.all_reduce(out)
