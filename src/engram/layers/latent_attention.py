"""Multi-head latent attention (MLA) as Kimi-Linear has it: no positional rotation.

Per token one latent (kv_lora_rank channels, RMS-normed) and qk_rope_head_dim key channels shared
by every head; kv_b_proj expands the latent into each head's key part and value. Here K and V are
expanded at every step and kept in the paged KV cache as every other attention layer keeps them:
the simplest exact design, at a cost. A token's cache row is 2 x heads x head_dim values (V
zero-padded to K's width, so one cache shape serves both) where the latent is kv_lora_rank +
qk_rope_head_dim: Kimi-Linear-48B-A3B keeps 2 x 32 x 192 = 12,288 values per token per attention
layer for a latent of 576, 21x (24 KiB in bf16, over 7 layers 168 KiB a token). Storing the latent
and absorbing kv_b_proj into q and o (DeepSeek's decode) would save that, with a kernel of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers.attention import paged_attend
from engram.layers.linear import Linear
from engram.layers.norm import RMSNorm
from engram.models.spec import AttentionSpec, LatentAttentionSpec


class LatentAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, hidden_size: int, layer_index: int):
        super().__init__()
        assert spec.latent is not None, "latent attention's spec has its latent dimensions"
        self.spec, self.latent = spec, spec.latent
        self.layer_index = layer_index
        lat: LatentAttentionSpec = spec.latent
        heads = spec.num_heads
        if lat.q_lora_rank is None:
            self.q_proj = Linear(hidden_size, heads * lat.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden_size, lat.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(lat.q_lora_rank, spec.norm_eps)
            self.q_b_proj = Linear(lat.q_lora_rank, heads * lat.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden_size, lat.kv_lora_rank + lat.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(lat.kv_lora_rank, spec.norm_eps)
        self.kv_b_proj = Linear(lat.kv_lora_rank, heads * (lat.qk_nope_head_dim + lat.v_head_dim), bias=False)
        self.o_proj = Linear(heads * lat.v_head_dim, hidden_size, bias=False)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        """To the cache's head width (K's and V's widest), with zeros: they add nothing to q.k."""
        return F.pad(x, (0, self.spec.head_dim - x.shape[-1]))

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s, lat = self.spec, self.latent
        q = self.q_proj(hidden) if lat.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(-1, s.num_heads, lat.qk_head_dim)
        latent, shared_key = self.kv_a_proj_with_mqa(hidden).split([lat.kv_lora_rank, lat.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(-1, s.num_heads, lat.qk_nope_head_dim + lat.v_head_dim)
        key_nope, value = kv.split([lat.qk_nope_head_dim, lat.v_head_dim], dim=-1)
        key = torch.cat([key_nope, shared_key[:, None, :].expand(-1, s.num_heads, -1)], dim=-1)
        out = paged_attend(self._pad(q), self._pad(key), self._pad(value), batch, self.layer_index, s.scaling)
        return self.o_proj(out[..., : lat.v_head_dim].reshape(-1, s.num_heads * lat.v_head_dim))
