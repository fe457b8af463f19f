"""Gated delta rule (gated DeltaNet, as in Qwen3-Next / Qwen3.5), torch reference.

Per value head, with state S [K, V], log decay g_t <= 0 and write strength beta_t in (0, 1):

    S' = exp(g_t) S;  u_t = beta_t (v_t - S'^T k_t);  S_t = S' + k_t u_t^T;  o_t = scale q_t^T S_t

Shapes: q and k [L, Hk, K], v [L, Hv, V], g and beta [L, Hv], state [Hv, K, V] (fla's layout).
Each q/k head serves Hv // Hk consecutive value heads (grouped value attention). Computation is
float32; outputs are float32.

Kimi Delta Attention (KDA) is the same rule with a decay per key channel: g [L, Hv, K], and
S' = diag(exp(g_t)) S. Every op takes either shape of g.
"""

from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the epsilon inside the root, as fla does)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, l2_norm_qk: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k -> float32, optionally L2-normed, q scaled, both repeated to the value heads."""
    q, k = q.float(), k.float()
    if l2_norm_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    repeat = num_v_heads // k.shape[-2]
    return q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)


def _decayed_products(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, lower: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA's intra-chunk products sum_d x_i[d] k_j[d] exp(c_i[d] - c_j[d]) for x = k and x = q, j <= i
    ([H, n, n] each). The decay of each pair is formed before the exponential, as transformers does:
    exp(c_i) * exp(-c_j) would overflow over a long chunk of strong decay."""
    decay = (c[:, :, None] - c[:, None, :]).masked_fill(~lower[..., None], -torch.inf).exp()  # [H, n, n, K]
    return torch.einsum("hid,hjd,hijd->hij", k, k, decay), torch.einsum("hid,hjd,hijd->hij", q, k, decay)


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
    """One sequence, chunked. Returns (o [L, Hv, V], final_state [Hv, K, V]). g [L, Hv] or, per
    key channel (KDA), [L, Hv, K].

    Inside a chunk with inclusive cumulative log decay c and entry state S0, the residuals U solve
    the unit lower-triangular system (I + A) U = beta V - beta exp(c) K S0 with
    A[i, j] = beta_i exp(c_i - c_j) k_i.k_j for j < i; then o_i = exp(c_i) q_i S0 +
    sum_{j<=i} exp(c_i - c_j) (q_i.k_j) u_j and S_end = exp(c_end) S0 + sum_j exp(c_end - c_j) k_j u_j^T."""
    length, heads, _ = v.shape
    per_channel = g.dim() == 3
    q, k = prepare_qk(q, k, heads, l2_norm_qk, scale)
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
        c = g[:, start:end].cumsum(dim=1)  # [H, n] (per channel: [H, n, K])
        bc = beta[:, start:end, None]
        if per_channel:
            kk, qk = _decayed_products(qc, kc, c, lower[:n, :n])
            tail, end_decay = (c[:, -1:] - c).exp(), c[:, -1, :, None].exp()  # [H, n, K], [H, K, 1]
            c = c.exp()  # the entry state's decay at each step, [H, n, K]
        else:
            mask = lower[:n, :n]
            decay = (c[:, :, None] - c[:, None, :]).masked_fill(~mask, -torch.inf).exp()  # [H, n, n]
            kk, qk = (kc @ kc.transpose(-1, -2)) * decay, (qc @ kc.transpose(-1, -2)) * decay
            tail, end_decay = (c[:, -1:] - c).exp()[..., None], c[:, -1].exp()[:, None, None]  # [H, n, 1], [H, 1, 1]
            c = c.exp()[..., None]
        # The solve reads only the strict lower triangle of A and takes the diagonal as ones.
        u = torch.linalg.solve_triangular(bc * kk, bc * vc - (bc * c * kc) @ state, upper=False, unitriangular=True)
        outputs.append((c * qc) @ state + qk @ u)
        state = end_decay * state + (tail * kc).transpose(-1, -2) @ u
    o = torch.cat(outputs, dim=1) if outputs else v.new_zeros(heads, 0, v.shape[-1])
    return o.transpose(0, 1), state


def gated_delta_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seq_lens: list[int],
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    chunk_size: int = 64,
    l2_norm_qk: bool = False,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill a flat batch (T = sum(seq_lens) rows). The initial states are state_pool[slots]
    [S, Hv, K, V]; the final states are written back there. Returns o [T, Hv, V] (float32).
    `cu_seqlens` (device) is for fast kernels; unused here."""
    initial = state_pool[slots]
    outs, finals = [], []
    parts = zip(*(t.split(seq_lens) for t in (q, k, v, g, beta)))
    for i, (qi, ki, vi, gi, bi) in enumerate(parts):
        o, final = gated_delta_chunk(qi, ki, vi, gi, bi, initial[i], chunk_size, l2_norm_qk, scale)
        outs.append(o)
        finals.append(final)
    state_pool[slots] = torch.stack(finals).to(state_pool.dtype)
    return torch.cat(outs)


def gated_delta_state_update(
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    l2_norm_qk: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode: one token for each of S sequences. q, k [S, Hk, K], v [S, Hv, V], g [S, Hv] (KDA:
    [S, Hv, K]) and beta [S, Hv]; state_pool[slots] [S, Hv, K, V] is advanced in place. Returns o [S, Hv, V] (float32)."""
    q, k = prepare_qk(q, k, v.shape[-2], l2_norm_qk, scale)
    s, o = gated_delta_step(state_pool[slots], q, k, v, g, beta)
    state_pool[slots] = s.to(state_pool.dtype)
    return o


def gated_delta_step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B states [B, Hv, K, V], q and k from `prepare_qk`, g [B, Hv] or per key
    channel [B, Hv, K]: (the new state, o [B, Hv, V]), in float32. Decode and a verify step's
    positions share it, so they round alike."""
    decay = g.float().exp()
    s = state.float() * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
    u = beta.float()[..., None] * (v.float() - (k[..., None] * s).sum(dim=-2))
    s = s + k[..., None] * u[..., None, :]
    return s, (q[..., None] * s).sum(dim=-2)
