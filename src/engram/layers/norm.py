from __future__ import annotations

import torch
from torch import nn

from engram.ops.dispatch import kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, weight_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32

    def scale(self) -> torch.Tensor:
        """What the normalized rows are multiplied by."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels().rms_norm(x, self.scale(), self.eps, self.weight_in_fp32)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None, residual_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual connection before this norm, fused with it: (norm(stream), stream) for
        stream = residual + x * residual_scale. With no residual yet, x itself starts the stream."""
        if residual is None:
            return self(x), x
        return kernels().add_rms_norm(x, residual, self.scale(), self.eps, residual_scale, self.weight_in_fp32)


class ZeroCenteredRMSNorm(RMSNorm):
    """Weights stored around 0 and applied as 1 + weight, in float32 before the cast back
    (Qwen3-Next, Qwen3.5)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps, weight_in_fp32=True)

    def scale(self) -> torch.Tensor:
        return self.weight.float() + 1.0
