"""Kimi Delta Attention (Kimi-Linear) over a flat batch, its state in the StatePool by slot.

The gated delta rule with a decay per head and key channel (`ops.gated_delta`, g [T, H, K]):
g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias), beta = sigmoid(b(x)), q, k and v each through a
causal conv with SiLU, q and k L2-normed; each head's output RMS-normed, then gated by
sigmoid(g_b(g_a(x))). One input projection yields [q | k | v | f_a | g_a | b], q, k and v first so
that at decode their conv update rides on the projection (`linear_conv_update`), as gated DeltaNet's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers.gated_deltanet import delta_rule, project_and_convolve
from engram.layers.linear import Linear
from engram.layers.norm import RMSNorm
from engram.models.spec import KimiDeltaSpec


class KimiDeltaAttention(nn.Module):
    def __init__(self, spec: KimiDeltaSpec, hidden_size: int, layer_index: int):
        super().__init__()
        self.spec = spec
        self.layer_index = layer_index
        d, qkv = spec.head_dim, spec.qkv_dim
        self.sizes = [spec.conv_dim, d, d, spec.num_heads]  # qkv, f_a, g_a, b
        self.in_proj = Linear(hidden_size, spec.in_proj_size, bias=False)
        self.conv1d = nn.Conv1d(spec.conv_dim, spec.conv_dim, spec.conv_kernel, groups=spec.conv_dim, bias=False)
        self.f_b_proj = Linear(d, qkv, bias=False)
        self.g_b_proj = Linear(d, qkv, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(qkv))
        self.A_log = nn.Parameter(torch.zeros(1, 1, spec.num_heads, 1))  # the checkpoint's shape
        self.o_norm = RMSNorm(d, spec.norm_eps, weight_in_fp32=True)
        self.o_proj = Linear(qkv, hidden_size, bias=False)

    def packed_parts(self) -> dict[str, tuple[str, slice]]:
        """Checkpoint parameter (relative name) -> (this module's parameter, its rows)."""
        s = self.spec
        names = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")
        starts = torch.tensor([0, *([s.qkv_dim] * 3), *self.sizes[1:]]).cumsum(0).tolist()
        parts = {f"{name}.weight": ("in_proj.weight", slice(starts[i], starts[i + 1])) for i, name in enumerate(names)}
        parts |= {f"{x}_conv1d.weight": ("conv1d.weight", slice(i * s.qkv_dim, (i + 1) * s.qkv_dim)) for i, x in enumerate("qkv")}
        return parts

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s = self.spec
        assert batch.verify is None, "speculative verify steps are refused for Kimi Delta Attention models at start-up"
        qkv, f, gate, b = project_and_convolve(hidden, self.in_proj, self.conv1d, self.sizes, batch, self.layer_index)
        q, key, v = qkv.reshape(-1, 3, s.num_heads, s.head_dim).unbind(1)
        decay = -self.A_log.float().reshape(-1, 1).exp() * F.softplus(
            self.f_b_proj(f).float().view(-1, s.num_heads, s.head_dim) + self.dt_bias.float().view(s.num_heads, s.head_dim)
        )
        beta = b.sigmoid()
        o = delta_rule(q, key, v, decay, beta, batch, self.layer_index, s.chunk_size)
        o = self.o_norm(o.reshape(-1, s.head_dim)) * torch.sigmoid(self.g_b_proj(gate).float().reshape(-1, s.head_dim))
        return self.o_proj(o.to(hidden.dtype).reshape(-1, s.qkv_dim))
