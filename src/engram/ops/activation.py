"""Gated activations, torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """h [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_gate(x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x * silu(gate) in float32, cast to `out_dtype` (a Mamba2 output gate without a norm: Falcon-H1)."""
    return (x.float() * F.silu(gate.float())).to(out_dtype)
