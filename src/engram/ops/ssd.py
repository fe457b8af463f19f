"""Mamba2 selective state space (SSD) ops, torch reference.

Shapes: x [L, H, P], dt [L, H] (already softplus'd and clamped), A [H] (negative), B and C
[L, G, N] with G groups shared by H // G heads, D [H], state [H, P, N]. Computation is float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engram.ops.norm import gated_rms_norm


def expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each group serves H // G consecutive heads."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., Q] -> [..., Q, Q] with out[l, s] = a[s+1] + ... + a[l] for s <= l, -inf above.

    Summing masked segments (instead of subtracting two cumulative sums) stays exact when the
    cumulative decay is large."""
    q = a.shape[-1]
    x = a[..., None].expand(*a.shape, q)
    strict = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~strict, 0).cumsum(dim=-2)
    inclusive = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device))
    return x.masked_fill(~inclusive, -torch.inf)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked SSD. Returns (y [L, H, P], final_state [H, P, N]) in float32."""
    length, heads, _ = x.shape
    x, dt = x.float(), dt.float()
    B, C = expand_groups(B.float(), heads), expand_groups(C.float(), heads)
    pad = (-length) % chunk_size
    # Padded steps have dt = 0: decay 1 and no input, so the final state is unchanged by them.
    xdt = torch.nn.functional.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))
    a = torch.nn.functional.pad(dt * A.float()[None], (0, 0, 0, pad))
    B = torch.nn.functional.pad(B, (0, 0, 0, 0, 0, pad))
    C = torch.nn.functional.pad(C, (0, 0, 0, 0, 0, pad))
    n_chunks = (length + pad) // chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n_chunks, chunk_size, *t.shape[1:])

    xdt, B, C = chunks(xdt), chunks(B), chunks(C)
    a = chunks(a).permute(0, 2, 1)  # [c, H, Q]
    a_cum = a.cumsum(dim=-1)

    # Within each chunk: attention-like form with the decay mask.
    decay = torch.exp(_segment_sum(a))  # [c, H, Q(l), Q(s)]
    scores = torch.einsum("clhn,cshn->chls", C, B) * decay
    y = torch.einsum("chls,cshp->clhp", scores, xdt)

    # Each chunk's contribution to the state at its end.
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [c, H, Q]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", B, to_end, xdt)

    # Across chunks: carry the state forward.
    chunk_decay = torch.exp(a_cum[..., -1])  # [c, H]
    state = initial_state.float()
    starts = []
    for c in range(n_chunks):
        starts.append(state)
        state = state * chunk_decay[c][:, None, None] + chunk_states[c]
    start_states = torch.stack(starts)  # [c, H, P, N]
    y = y + torch.einsum("clhn,chpn,chl->clhp", C, start_states, torch.exp(a_cum))

    y = y.reshape(n_chunks * chunk_size, heads, -1)[:length]
    return y + x * D.float()[:, None], state


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of S sequences: state [S, H, P, N], x [S, H, P], dt [S, H], B/C [S, G, N].

    Returns (y [S, H, P], new_state [S, H, P, N]) in float32."""
    heads = x.shape[1]
    x, dt = x.float(), dt.float()
    B, C = expand_groups(B.float(), heads), expand_groups(C.float(), heads)
    decay = torch.exp(dt * A.float()[None])  # [S, H]
    new_state = state.float() * decay[..., None, None] + (x * dt[..., None])[..., None] * B[:, :, None, :]
    y = torch.einsum("shpn,shn->shp", new_state, C) + x * D.float()[:, None]
    return y, new_state


def ssd_sequential(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence by definition, one token at a time: the reference for the ops here."""
    state = initial_state.float()[None]
    ys = []
    for t in range(x.shape[0]):
        y, state = ssd_step(state, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D)
        ys.append(y[0])
    return torch.stack(ys), state[0]


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float], A_log: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw dt [T, H] (from the input projection) -> (softplus(dt + bias) clamped, A = -exp(A_log)), float32."""
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(*dt_limit)
    return dt, -torch.exp(A_log.float())


def ssd_state_update(
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """Decode: one token for each of S sequences, raw dt [S, H]; ssm_pool[slots] [S, H, P, N] is
    advanced in place. Returns y [S, H, P] in float32."""
    dt, A = discretize(dt, dt_bias, dt_limit, A_log)
    y, new_state = ssd_step(ssm_pool[slots], x, dt, A, B, C, D)
    ssm_pool[slots] = new_state.to(ssm_pool.dtype)
    return y


def ssd_state_update_norm_linear(
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    group_size: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mamba2's decode output as one op: the state update, the gated RMS norm of y with gate [S, H * P]
    (cast to the projection's dtype) and the output projection. One op so that the fast path can
    give the norm no launch of its own."""
    y = ssd_state_update(ssm_pool, slots, x, dt, dt_bias, dt_limit, A_log, B, C, D)
    h = gated_rms_norm(y.reshape(x.shape[0], -1), gate, norm_weight, eps, group_size, weight.dtype)
    return F.linear(h, weight, bias)


def ssd_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    seq_lens: list[int],
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flat batch of sequences (x [T, H, P], T = sum(seq_lens)), raw dt [T, H]. The initial states
    are ssm_pool[slots]; the final states are written back there. Returns y [T, H, P] (float32).
    `cu_seqlens` (device) is for fast kernels; unused here."""
    dt, A = discretize(dt, dt_bias, dt_limit, A_log)
    initial = ssm_pool[slots]
    ys, finals = [], []
    for i, (xi, dti, Bi, Ci) in enumerate(zip(*(t.split(seq_lens) for t in (x, dt, B, C)))):
        y, final = ssd_chunk_scan(xi, dti, A, Bi, Ci, D, chunk_size, initial[i])
        ys.append(y)
        finals.append(final)
    ssm_pool[slots] = torch.stack(finals).to(ssm_pool.dtype)
    return torch.cat(ys)
