"""The gated delta rule token by token (Qwen3-Next / Qwen3.5 decode and short prefills), state by slot.

`ops.gated_delta`'s contract: q, k [T, Hk, K], v [T, Hv, V], g and beta [T, Hv] (g per key
channel, Kimi Delta Attention: [T, Hv, K]), the pool [slots, Hv, K, V]. One program per (sequence, value head, block of V columns) keeps its [K, BV]
slice of the state in registers, reads it from the pool at the sequence's slot and writes it back;
a slot of -1 (a decode graph's padding row) touches nothing. No host work: CUDA-graph safe.

Its VERIFY variant is a speculative verify step's (ops/verify.py:gated_delta_verify): the pool is
read, not written, and the state after each of the sequence's L positions is kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engram.ops.triton_ops.common import PDL_LAUNCH, cu_seqlens_of, keep_verified, np2, verify_args, verify_row, wait_for_previous_kernel


@triton.jit
def _gated_delta_kernel(
    Pool,
    Slots,
    Cu,
    Q,
    K,
    V,
    G,
    Beta,
    O,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_ot,
    stride_oh,
    DK,
    DV,
    GROUP,
    scale,
    Rows,
    States,
    stride_rs,
    stride_ss,
    stride_sl,
    stride_sh,
    stride_sk,
    L,
    VARLEN: tl.constexpr,
    L2NORM: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    VERIFY: tl.constexpr,
):
    """VERIFY: the sequence's L positions are the flat rows Rows[s, :] (past its length its last
    row again, whose o is not stored twice), the state after each is stored in States[s, t]
    (rounded to its dtype and carried on rounded, as decode steps carry the pool's), and the pool
    is not written; a padding sequence (slot -1) starts from zeros."""
    wait_for_previous_kernel()
    s = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    hk = hv // GROUP
    slot = tl.load(Slots + s).to(tl.int64)
    if not VERIFY:
        if slot < 0:
            return
    rk = tl.arange(0, BLOCK_K)
    rv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    km, vm = rk < DK, rv < DV
    ptr = Pool + slot * stride_ps + hv * stride_ph + rk[:, None] * stride_pk + rv[None, :]
    m2 = km[:, None] & vm[None, :]
    st = tl.load(ptr, mask=tl.where(slot >= 0, m2, False), other=0.0).to(tl.float32)
    if VERIFY:
        start = 0
        end = L
    elif VARLEN:
        start, end = tl.load(Cu + s), tl.load(Cu + s + 1)
    else:  # one token per sequence: row s
        start, end = s, s + 1
    out = States + s * stride_ss + hv * stride_sh + rk[:, None] * stride_sk + rv[None, :]
    last = s * 0 - 1  # VERIFY: the flat row whose o was stored last (int64)
    for i in range(start, end):
        t = verify_row(Rows, stride_rs, s, i, VERIFY)
        q = tl.load(Q + t * stride_qt + hk * stride_qh + rk, mask=km, other=0.0).to(tl.float32)
        k = tl.load(K + t * stride_kt + hk * stride_kh + rk, mask=km, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
        q = q * scale
        v = tl.load(V + t * stride_vt + hv * stride_vh + rv, mask=vm, other=0.0).to(tl.float32)
        beta = tl.load(Beta + t * stride_bt + hv).to(tl.float32)
        if PER_CHANNEL:
            g = tl.load(G + t * stride_gt + hv * stride_gh + rk, mask=km, other=0.0).to(tl.float32)
            st = st * tl.exp(g)[:, None]
        else:
            st = st * tl.exp(tl.load(G + t * stride_gt + hv * stride_gh).to(tl.float32))
        u = beta * (v - tl.sum(st * k[:, None], axis=0))
        st = st + k[:, None] * u[None, :]
        o = tl.sum(st * q[:, None], axis=0)
        if VERIFY:
            st = keep_verified(O + t * stride_ot + hv * stride_oh + rv, o, vm, t, last, out + i * stride_sl, st, m2)
            last = t
        else:
            tl.store(O + t * stride_ot + hv * stride_oh + rv, o, mask=vm)
    if not VERIFY:
        tl.store(ptr, st.to(Pool.dtype.element_ty), mask=m2)


def _launch(q, k, v, g, beta, state_pool, slots, cu_seqlens, num_seqs, l2_norm_qk, scale, verify=None) -> torch.Tensor:
    """The kernel over num_seqs sequences; `verify`: (rows, states) for its VERIFY variant."""
    T, Hk, DK = q.shape
    Hv, DV = v.shape[1], v.shape[2]
    o = torch.empty((T, Hv, DV), dtype=torch.float32, device=q.device)
    if num_seqs == 0 or T == 0:
        return o
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and state_pool.stride(3) == 1
    g, beta = g.contiguous(), beta.contiguous()
    bv = min(32, np2(DV))
    _gated_delta_kernel[(num_seqs, Hv, triton.cdiv(DV, bv))](
        state_pool,
        slots,
        slots if cu_seqlens is None else cu_seqlens,
        q,
        k,
        v,
        g,
        beta,
        o,
        state_pool.stride(0),
        state_pool.stride(1),
        state_pool.stride(2),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        o.stride(0),
        o.stride(1),
        DK,
        DV,
        Hv // Hk,
        DK**-0.5 if scale is None else scale,
        *verify_args(verify, slots, o),
        VARLEN=cu_seqlens is not None,
        L2NORM=l2_norm_qk,
        PER_CHANNEL=g.dim() == 3,
        BLOCK_K=np2(DK),
        BLOCK_V=bv,
        VERIFY=verify is not None,
        num_warps=4,
        **PDL_LAUNCH,
    )
    return o


def gated_delta_varlen_scan(q, k, v, g, beta, seq_lens, state_pool, slots, chunk_size=64, l2_norm_qk=False, scale=None, cu_seqlens=None):
    """`ops.gated_delta.gated_delta_varlen` by the recurrence itself (short sequences; chunk_size unused)."""
    if cu_seqlens is None:
        cu_seqlens = cu_seqlens_of(seq_lens, q.device)
    return _launch(q, k, v, g, beta, state_pool, slots, cu_seqlens, len(seq_lens), l2_norm_qk, scale)


def gated_delta_state_update(state_pool, slots, q, k, v, g, beta, l2_norm_qk=False, scale=None):
    """`ops.gated_delta.gated_delta_state_update`: one token per sequence, padding rows (slot -1) skipped."""
    return _launch(q, k, v, g, beta, state_pool, slots, None, q.shape[0], l2_norm_qk, scale)


def gated_delta_verify(q, k, v, g, beta, rows, flat, state_pool, slots, states, l2_norm_qk=False, scale=None):
    """`verify.gated_delta_verify` in one launch (the kernel's VERIFY variant), over fixed [S, L]
    positions read from device memory (a verify graph can hold it); `flat` is implied by `rows`."""
    return _launch(q, k, v, g, beta, state_pool, slots, None, rows.shape[0], l2_norm_qk, scale, (rows, states))
