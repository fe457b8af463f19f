"""Speculative verification of a Mamba2 layer, torch reference: the states after every position.

A verify step feeds each sequence its last sampled token and up to k drafted ones. Attention
can drop the KV of rejected tokens, a recurrent state cannot "unsee" them, so these ops leave the
pool untouched and keep, per sequence, what each position's state would be:

- conv: a window [K-1 + L, C], the old conv state followed by the step's inputs; the state after
  f fed tokens is its rows [f, f + K-1).
- SSM: the recurrent form (exact for small k, and the same arithmetic as a decode step, so greedy
  output matches plain decoding), the state after each position [L, H, P, N].

`commit_verified` then writes the state after each sequence's accepted tokens into the pool by
slot. A fused CUDA path slots in here, in `ops/dispatch.py`'s `KernelSet` (`causal_conv1d_verify`,
`ssd_verify`, `commit_verified`): one kernel per op over the padded [S, L] positions, reading
`fed` from device memory so that a verify step of a given (batch, k) can be captured in a graph.
"""

from __future__ import annotations

import torch

from engram.ops.conv import causal_conv1d_step
from engram.ops.ssd import discretize, ssd_step


def padded_rows(seq_lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat rows of a batch as [S, L] (L the longest), clamped into range, and which are real."""
    lens = torch.tensor(seq_lens, device=device)
    starts = torch.cumsum(lens, 0) - lens
    steps = torch.arange(max(seq_lens), device=device)
    valid = steps[None] < lens[:, None]
    rows = torch.minimum(starts[:, None] + steps[None], starts[:, None] + lens[:, None] - 1)
    return rows, valid


def causal_conv1d_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: list[int],
    windows: torch.Tensor,
) -> torch.Tensor:
    """Flat batch x [T, C] split by seq_lens; conv_pool[slots] read, not written. Fills windows
    [S, K-1 + L, C] and returns silu(conv(x)) [T, C], position by position as a decode step does."""
    rows, valid = padded_rows(seq_lens, x.device)
    k1 = conv_pool.shape[1]
    full = torch.cat([conv_pool[slots].to(x.dtype), x[rows] * valid[..., None]], dim=1)  # [S, K-1 + L, C]
    windows[:, : full.shape[1]] = full.to(windows.dtype)
    ys = [causal_conv1d_step(full[:, t + k1], weight, bias, full[:, t : t + k1])[0] for t in range(rows.shape[1])]
    return torch.stack(ys, dim=1)[valid]


def ssd_verify(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    seq_lens: list[int],
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """Flat batch (x [T, H, P], raw dt [T, H]) from ssm_pool[slots], which is read, not written.
    Fills states [S, L, H, P, N] (in the pool's dtype, rounded at every position as a decode step
    rounds) and returns y [T, H, P] in float32. Padding positions have dt 0: the state carries over."""
    rows, valid = padded_rows(seq_lens, x.device)
    dt, A = discretize(dt, dt_bias, dt_limit, A_log)
    state = ssm_pool[slots]
    ys = []
    for t in range(rows.shape[1]):
        r = rows[:, t]
        y, new = ssd_step(state, x[r], dt[r] * valid[:, t, None], A, B[r], C[r], D)
        states[:, t] = new.to(states.dtype)
        state = states[:, t]
        ys.append(y)
    return torch.stack(ys, dim=1)[valid]


def commit_verified(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    windows: torch.Tensor,
    states: torch.Tensor,
    rows: torch.Tensor,
    fed: torch.Tensor,
) -> None:
    """For each i: the state after fed[i] >= 1 tokens of verify row rows[i] into pool slot slots[i]."""
    k1 = conv_pool.shape[1]
    cols = fed[:, None] + torch.arange(k1, device=fed.device)[None]
    conv_pool[slots] = windows[rows[:, None], cols].to(conv_pool.dtype)
    ssm_pool[slots] = states[rows, fed - 1].to(ssm_pool.dtype)
