"""RMS norms, torch reference (statistics in float32, as the HF implementations do)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False) -> torch.Tensor:
    """`weight_in_fp32`: Nemotron-H multiplies by the weight before casting back (others after)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (weight.float() * h).to(dtype)
    return weight * h.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: float = 1.0, weight_in_fp32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's residual connection and the next norm: the stream `residual + x * scale` (in the
    residual's dtype, which may be float32) and the RMS norm of the stream cast to x's dtype."""
    if scale != 1.0:
        x = x * scale
    residual = residual + x
    return rms_norm(residual.to(x.dtype), weight, eps, weight_in_fp32), residual


def add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: float, linear_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm`, then a bias-free linear layer on the normalized rows, as one op (the fast path
    fuses them for a layer with few outputs: a MoE router). Returns (normalized, stream, output)."""
    h, residual = add_rms_norm(x, residual, weight, eps, scale)
    return h, residual, F.linear(h, linear_weight)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mamba2's output norm: RMS-normalize x * silu(gate) within groups of `group_size` channels.
    The result (weight * normalized, in the promoted dtype) is cast to `out_dtype` when given."""
    dtype = x.dtype
    h = x.float() * F.silu(gate.float())
    g = h.view(*h.shape[:-1], -1, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * g.view_as(h).to(dtype)
    return out if out_dtype is None else out.to(out_dtype)


def norm_then_gate(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Falcon-H1's output norm with norm_before_gate: weight * RMS-normalized x (within groups of
    `group_size` channels), times silu(gate), in float32, cast to `out_dtype`."""
    h = x.float()
    g = h.view(*h.shape[:-1], -1, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * g.view_as(h) * F.silu(gate.float())).to(out_dtype)
