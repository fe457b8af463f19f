"""Gated delta rule (gated DeltaNet, as in Qwen3-Next / Qwen3.5), torch reference.

Per value head, with state S [K, V], log decay g_t <= 0 and write strength beta_t in (0, 1):

    S' = exp(g_t) S;  u_t = beta_t (v_t - S'^T k_t);  S_t = S' + k_t u_t^T;  o_t = scale q_t^T S_t

Shapes: q and k [L, Hk, K], v [L, Hv, V], g and beta [L, Hv], state [Hv, K, V] (fla's layout).
Each q/k head serves Hv // Hk consecutive value heads (grouped value attention). Computation is
float32; outputs are float32.
"""

from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the epsilon inside the root, as fla does)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, l2_norm_qk: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k -> float32, optionally L2-normed, q scaled, both repeated to the value heads."""
    q, k = q.float(), k.float()
    if l2_norm_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    repeat = num_v_heads // k.shape[-2]
    return q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)


def gated_delta_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = 64,
    l2_norm_qk: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked. Returns (o [L, Hv, V], final_state [Hv, K, V]).

    Inside a chunk with inclusive cumulative log decay c and entry state S0, the residuals U solve
    the unit lower-triangular system (I + A) U = beta V - beta exp(c) K S0 with
    A[i, j] = beta_i exp(c_i - c_j) k_i.k_j for j < i; then o_i = exp(c_i) q_i S0 +
    sum_{j<=i} exp(c_i - c_j) (q_i.k_j) u_j and S_end = exp(c_end) S0 + sum_j exp(c_end - c_j) k_j u_j^T."""
    length, heads, _ = v.shape
    q, k = _prepare(q, k, heads, l2_norm_qk, scale)
    # [H, L, .] per head; padded steps have g = 0 and beta = 0: no decay, no write.
    q, k, v = (t.transpose(0, 1) for t in (q, k, v.float()))
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)
    state = initial_state.float().clone()
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    outputs = []
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        n = end - start
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
        c = g[:, start:end].cumsum(dim=-1)  # [H, n]
        bc = beta[:, start:end, None]
        mask = lower[:n, :n]
        decay = (c[:, :, None] - c[:, None, :]).masked_fill(~mask, -torch.inf).exp()  # [H, n, n]
        # The solve reads only the strict lower triangle of A and takes the diagonal as ones.
        system = bc * (kc @ kc.transpose(-1, -2)) * decay
        rhs = bc * vc - (bc * c.exp()[..., None] * kc) @ state
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outputs.append(c.exp()[..., None] * (qc @ state) + ((qc @ kc.transpose(-1, -2)) * decay) @ u)
        tail = (c[:, -1:] - c).exp()[..., None]  # [H, n, 1]
        state = c[:, -1].exp()[:, None, None] * state + (tail * kc).transpose(-1, -2) @ u
    o = torch.cat(outputs, dim=1) if outputs else v.new_zeros(heads, 0, v.shape[-1])
    return o.transpose(0, 1), state


def gated_delta_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: list[int],
    initial_states: torch.Tensor,
    chunk_size: int = 64,
    l2_norm_qk: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat varlen batch: sequence s is rows cu_seqlens[s]:cu_seqlens[s+1] and starts from
    initial_states[s]. Returns (o [T, Hv, V], final_states [S, Hv, K, V])."""
    outs, finals = [], []
    for s, (a, b) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        o, final = gated_delta_chunk(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], initial_states[s], chunk_size, l2_norm_qk, scale)
        outs.append(o)
        finals.append(final)
    return torch.cat(outs), torch.stack(finals)


def gated_delta_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    l2_norm_qk: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode: one token per sequence. q, k [B, Hk, K], v [B, Hv, V], g and beta [B, Hv],
    state [B, Hv, K, V] updated in place (in its own dtype). Returns o [B, Hv, V]."""
    q, k = _prepare(q, k, v.shape[-2], l2_norm_qk, scale)
    s = state.float() * g.float().exp()[..., None, None]
    u = beta.float()[..., None] * (v.float() - (k[..., None] * s).sum(dim=-2))
    s = s + k[..., None] * u[..., None, :]
    state.copy_(s)
    return (q[..., None] * s).sum(dim=-2)
