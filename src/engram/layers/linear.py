"""nn.Linear whose forward goes through the kernel dispatch (a GEMV at decode batch sizes on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from engram.ops.dispatch import kernels


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels().linear(x, self.weight, self.bias)
