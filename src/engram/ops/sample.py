"""Token choice from logits, torch reference."""

from __future__ import annotations

import torch


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's index of its largest logit, [R] int64 (the first among equal ones)."""
    return torch.argmax(logits, dim=-1, out=out)
