"""Speculative verification of a recurrent layer, torch reference: the states after every position.

A verify step feeds each sequence its last sampled token and up to k drafted ones. Attention
can drop the KV of rejected tokens, a recurrent state cannot "unsee" them, so these ops leave the
pool untouched and keep, per sequence, what each position's state would be:

- a conv (Mamba2's, gated DeltaNet's, LFM2's short conv): a window [K-1 + L, C], the old conv state
  followed by the step's inputs; the state after f fed tokens is its rows [f, f + K-1).
- a scan (Mamba2's SSM, the gated delta rule): the recurrent form (exact for small k, and the same
  arithmetic as a decode step, so greedy output matches plain decoding), the state after each
  position [L, *state].

The positions are laid out as [S, L] by `verify_layout` once per step (device tensors, so no op
here reads host data and a step of fixed (S, L) can be captured in a CUDA graph): `rows` [S, L],
each position's row of the flat batch (clamped to the sequence's last one past its length), and
`flat` [T], each flat row's place in the [S * L] layout. Everything is computed over all positions
at once, except a scan state's recurrence, which stays sequential over the L positions because a
closed form over positions would round differently from decode.

`commit_windows` and `commit_states` then write the state after each sequence's accepted tokens
into the pool by slot, one state tensor at a time, whatever the mixer. The CUDA set replaces
`causal_conv1d_verify`, `ssd_verify` and `gated_delta_verify` with one Triton launch each
(triton_ops/conv.py, triton_ops/ssd.py, triton_ops/gated_delta.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engram.ops.gated_delta import gated_delta_step, prepare_qk
from engram.ops.ssd import discretize, expand_groups


def verify_layout(seq_lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [S, L], flat [T]) of a verify step whose sequences feed seq_lens tokens, L the longest."""
    lens = torch.tensor(seq_lens)
    width = max(seq_lens)
    starts = torch.cumsum(lens, 0) - lens
    steps = torch.arange(width)
    rows = torch.minimum(starts[:, None] + steps[None], starts[:, None] + lens[:, None] - 1)
    flat = (torch.arange(len(seq_lens)) * width).repeat_interleave(lens) + torch.arange(int(lens.sum())) - starts.repeat_interleave(lens)
    return rows.to(device), flat.to(device)


def causal_conv1d_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    flat: torch.Tensor,
    windows: torch.Tensor,
    silu: bool = True,
) -> torch.Tensor:
    """Flat batch x [T, C]; conv_pool[slots] read, not written. Fills windows [S, K-1 + L, C] and
    returns silu(conv(x)) [T, C] (conv(x) without `silu`: LFM2's short conv), each position as a
    decode step computes it (same einsum)."""
    k1 = conv_pool.shape[1]
    full = torch.cat([conv_pool[slots].to(x.dtype), x[rows]], dim=1)  # [S, K-1 + L, C]
    windows.copy_(full)
    y = torch.einsum("slck,ck->slc", full.unfold(1, k1 + 1, 1), weight.to(x.dtype))  # [S, L, C]
    if bias is not None:
        y = y + bias
    return (F.silu(y) if silu else y).flatten(0, 1)[flat]


def ssd_verify(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    rows: torch.Tensor,
    flat: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """Flat batch (x [T, H, P], raw dt [T, H]) from ssm_pool[slots], which is read, not written.
    Fills states [S, L, H, P, N] (in the pool's dtype, rounded at every position as a decode step
    rounds) and returns y [T, H, P] in float32, y from the unrounded state as at decode."""
    heads = x.shape[1]
    dt, A = discretize(dt, dt_bias, dt_limit, A_log)
    xs, dts = x[rows].float(), dt[rows]  # [S, L, H, P], [S, L, H]
    decay = torch.exp(dts * A[None, None])[..., None, None]
    inputs = (xs * dts[..., None])[..., None] * expand_groups(B[rows].float(), heads)[..., None, :]  # [S, L, H, P, N]
    exact = states if states.dtype == torch.float32 else torch.empty(states.shape, dtype=torch.float32, device=states.device)
    state = ssm_pool[slots]
    for t in range(rows.shape[1]):
        torch.mul(state, decay[:, t], out=exact[:, t])
        exact[:, t].add_(inputs[:, t])
        if exact is not states:
            states[:, t] = exact[:, t]
        state = states[:, t]
    y = torch.einsum("slhpn,slhn->slhp", exact, expand_groups(C[rows].float(), heads)) + xs * D.float()[:, None]
    return y.flatten(0, 1)[flat]


def gated_delta_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    rows: torch.Tensor,
    flat: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    states: torch.Tensor,
    l2_norm_qk: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """The gated delta rule over a flat batch (q, k [T, Hk, K], v [T, Hv, V], g, beta [T, Hv]) from
    state_pool[slots], which is read, not written. Fills states [S, L, Hv, K, V] (in their dtype,
    carried on rounded as decode steps carry the pool's) and returns o [T, Hv, V] in float32, each
    position as `gated_delta_state_update` computes it."""
    qs, ks = prepare_qk(q[rows], k[rows], v.shape[-2], l2_norm_qk, scale)  # [S, L, Hv, K]
    vs, gs, bs = v[rows], g[rows], beta[rows]
    o = torch.empty((*rows.shape, *v.shape[1:]), dtype=torch.float32, device=v.device)  # [S, L, Hv, V]
    state = state_pool[slots]
    for t in range(rows.shape[1]):
        s, o[:, t] = gated_delta_step(state, qs[:, t], ks[:, t], vs[:, t], gs[:, t], bs[:, t])
        states[:, t] = s
        state = states[:, t]
    return o.flatten(0, 1)[flat]


def commit_windows(pool: torch.Tensor, slots: torch.Tensor, windows: torch.Tensor, rows: torch.Tensor, fed: torch.Tensor) -> None:
    """For each i: the conv state after fed[i] >= 1 tokens of verify row rows[i] (its window's rows
    [fed, fed + K-1)) into pool slot slots[i]."""
    cols = fed[:, None] + torch.arange(pool.shape[1], device=fed.device)[None]
    pool[slots] = windows[rows[:, None], cols].to(pool.dtype)


def commit_states(pool: torch.Tensor, slots: torch.Tensor, states: torch.Tensor, rows: torch.Tensor, fed: torch.Tensor) -> None:
    """For each i: the scan state after fed[i] >= 1 tokens of verify row rows[i] into pool slot slots[i]."""
    pool[slots] = states[rows, fed - 1].to(pool.dtype)
