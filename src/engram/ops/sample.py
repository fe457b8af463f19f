"""Token choice from logits, torch reference."""

from __future__ import annotations

import torch


def argmax(
    logits: torch.Tensor, out: torch.Tensor | None = None, host_out: torch.Tensor | None = None, turn: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's index of its largest logit, [R] int64 (the first among equal ones). With
    `host_out` (int64 [2, >= R], in host memory) and a decode graph's `turn` (ops/staging.py), the
    ids also go to host_out[turn[1]]."""
    out = torch.argmax(logits, dim=-1, out=out)
    if host_out is not None:
        assert turn is not None, "host_out needs the decode graph's turn"
        host_out[:, : out.shape[0]].index_copy_(0, turn[1:2].to(host_out.device), out[None].to(host_out.device))
    return out
