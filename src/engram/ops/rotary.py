"""Rotary position embedding (half-rotation layout, optionally on the first `rotary_dim` dims)."""

from __future__ import annotations

import torch


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=positions.device) / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, rotary_dim]."""
    rd = cos.shape[-1]
    rot, passthrough = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    rot = rot * cos[:, None] + rotated * sin[:, None]
    return torch.cat([rot, passthrough], dim=-1)
