"""LFM2's gated short convolution over a flat batch, its conv window in the state cache by slot.

in_proj yields [B | C | x]; the causal depthwise conv (no activation) runs over B * x, from the
sequence's last `conv_kernel - 1` such inputs, and its output is gated by C before out_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers.linear import Linear
from engram.models.spec import ShortConvSpec
from engram.ops.dispatch import kernels


class ShortConv(nn.Module):
    def __init__(self, spec: ShortConvSpec, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        h = spec.hidden_size
        self.in_proj = Linear(h, 3 * h, bias=spec.bias)
        self.conv = nn.Conv1d(h, h, spec.conv_kernel, groups=h, bias=spec.bias)
        self.out_proj = Linear(h, h, bias=spec.bias)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        k = kernels()
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        pool, slots = batch.state_pool.of(self.layer_index, "conv"), batch.state_slots
        weight = self.conv.weight[:, 0, :]
        if batch.is_decode:
            y = k.short_conv1d_update(b * x, weight, self.conv.bias, pool, slots)
        elif (v := batch.verify) is not None:  # a speculative step: every position's window kept, the pool left as it is
            y = k.short_conv1d_verify(b * x, weight, self.conv.bias, pool, slots, v.rows, v.flat, v.windows[self.layer_index, "conv"])
        else:
            y = k.short_conv1d_varlen(b * x, weight, self.conv.bias, pool, slots, batch.seq_lens, batch.cu_seqlens)
        return self.out_proj(c * y)
