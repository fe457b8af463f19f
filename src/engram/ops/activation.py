"""Gated activations, torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """h [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up
