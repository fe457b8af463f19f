"""The short causal conv1d, state in the pool [slots, K-1, C]: the single-token update and the
varlen prefill, with Mamba2's SiLU or without it (LFM2's short conv: `silu=False`). A slot of -1 (a
CUDA graph's padding row) reads a zero window and writes nothing.

Each thread owns whole channels: every state row is a 1-D vector over the same channels, loaded
before any row is stored, so the in-place shift has no cross-thread hazard. K <= 4 (Mamba2 uses 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engram.ops.triton_ops.common import PDL_LAUNCH, cu_seqlens_of, wait_for_previous_kernel


@triton.jit
def conv_window(state, stride_pk, w, stride_wk, m, sm, K: tl.constexpr):
    """The pool's window rows and the conv weights of a block of (sequence, channel) entries:
    (s0, s1, s2, w0, w1, w2, w3), rows past K - 1 and weights past K as zeros. `state` points at row
    0 of each entry's window, `w` at its weight row; masks `m` (channel valid) and `sm` (and a state
    to touch). The taps K leaves out are constexpr branches, not masks: Triton's interpreter takes
    no mask of a tensor and a Python bool."""
    s0 = tl.load(state, mask=sm, other=0.0)
    w0 = tl.load(w, mask=m, other=0.0)
    w1 = tl.load(w + stride_wk, mask=m, other=0.0)
    s1, s2 = tl.zeros_like(s0), tl.zeros_like(s0)
    w2, w3 = tl.zeros_like(w0), tl.zeros_like(w0)
    if K >= 3:
        s1 = tl.load(state + stride_pk, mask=sm, other=0.0)
        w2 = tl.load(w + 2 * stride_wk, mask=m, other=0.0)
    if K >= 4:
        s2 = tl.load(state + 2 * stride_pk, mask=sm, other=0.0)
        w3 = tl.load(w + 3 * stride_wk, mask=m, other=0.0)
    return s0, s1, s2, w0, w1, w2, w3


@triton.jit
def conv_value(x, window, bias, K: tl.constexpr, SILU: tl.constexpr):
    """One token of the causal conv from its `conv_window`: conv, or silu(conv) with SILU, in float32."""
    s0, s1, s2, w0, w1, w2, w3 = window
    xdt = x.dtype
    acc = s0.to(xdt).to(tl.float32) * w0.to(tl.float32)
    wl = w1
    if K >= 3:
        acc += s1.to(xdt).to(tl.float32) * w1.to(tl.float32)
        wl = w2
    if K >= 4:
        acc += s2.to(xdt).to(tl.float32) * w2.to(tl.float32)
        wl = w3
    acc += x.to(tl.float32) * wl.to(tl.float32)
    acc += bias
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc


@triton.jit
def conv_apply(x, window, state, stride_pk, bias, sm, K: tl.constexpr, SILU: tl.constexpr):
    """`conv_value`, and the window in the pool shifted in place (every row was loaded before any is
    stored)."""
    s0, s1, s2, w0, w1, w2, w3 = window
    acc = conv_value(x, window, bias, K, SILU)
    pt = state.dtype.element_ty
    if K == 2:
        tl.store(state, x.to(pt), mask=sm)
    elif K == 3:
        tl.store(state, s1.to(pt), mask=sm)
        tl.store(state + stride_pk, x.to(pt), mask=sm)
    else:
        tl.store(state, s1.to(pt), mask=sm)
        tl.store(state + stride_pk, s2.to(pt), mask=sm)
        tl.store(state + 2 * stride_pk, x.to(pt), mask=sm)
    return acc


@triton.jit
def conv_step(x, state, stride_pk, w, stride_wk, bias, m, sm, K: tl.constexpr, SILU: tl.constexpr):
    """`conv_apply` of the window loaded here."""
    return conv_apply(x, conv_window(state, stride_pk, w, stride_wk, m, sm, K), state, stride_pk, bias, sm, K, SILU)


@triton.jit
def _conv_update_kernel(
    X,
    W,
    Bias,
    Pool,
    Slots,
    Y,
    stride_x,
    stride_wc,
    stride_wk,
    stride_ps,
    stride_pk,
    stride_y,
    C,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The window and the weights are read before the wait: the projection before this kernel
    writes neither."""
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    slot = tl.load(Slots + s).to(tl.int64)
    state = Pool + slot * stride_ps + c
    sm = tl.where(slot >= 0, cm, False)
    window = conv_window(state, stride_pk, W + c * stride_wc, stride_wk, cm, sm, K)
    bias = tl.load(Bias + c, mask=cm, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    wait_for_previous_kernel()
    x = tl.load(X + s * stride_x + c, mask=cm, other=0.0)
    y = conv_apply(x, window, state, stride_pk, bias, sm, K, SILU)
    tl.store(Y + s * stride_y + c, y.to(Y.dtype.element_ty), mask=cm)


def _conv_strides(x, weight, conv_pool) -> tuple[int, ...]:
    """The input, weight and pool strides the conv kernels take, in their order."""
    return x.stride(0), weight.stride(0), weight.stride(1), conv_pool.stride(0), conv_pool.stride(1)


def _slot_conv_args(x, weight, bias, conv_pool, slots, y) -> tuple:
    """The leading arguments of the kernels over one row of x per program row (update, verify):
    X, W, Bias, Pool, Slots, Y, their strides, C."""
    return (x, weight, bias if bias is not None else weight, conv_pool, slots, y, *_conv_strides(x, weight, conv_pool), y.stride(0), x.shape[1])


def launch_conv_update(x, weight, bias, conv_pool, slots, y, silu=True):
    S, C = x.shape
    K = weight.shape[1]
    assert 2 <= K <= 4, "the fused conv update handles kernel widths 2..4"
    if S:
        block = 256
        _conv_update_kernel[(S, triton.cdiv(C, block))](
            *_slot_conv_args(x, weight, bias, conv_pool, slots, y),
            K=K,
            HAS_BIAS=bias is not None,
            SILU=silu,
            BLOCK_C=block,
            num_warps=4,
            **PDL_LAUNCH,
        )
    return y


def causal_conv1d_update(x, weight, bias, conv_pool, slots, silu=True):
    """Decode: one token for each of S sequences (x [S, C]); conv_pool[slots] is advanced in place."""
    return launch_conv_update(x, weight, bias, conv_pool, slots, torch.empty_like(x), silu)


@triton.jit
def _conv_varlen_kernel(
    X,
    W,
    Bias,
    Pool,
    Slots,
    Cu,
    Y,
    stride_x,
    stride_wc,
    stride_wk,
    stride_ps,
    stride_pk,
    stride_y,
    C,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    wait_for_previous_kernel()
    s = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(Cu + s).to(tl.int64)
    n = tl.load(Cu + s + 1).to(tl.int64) - start
    if tl.program_id(1) * BLOCK_T >= n:
        return
    slot = tl.load(Slots + s).to(tl.int64)
    tm = t < n
    cm = c < C
    sm = tl.where(slot >= 0, tm, False)  # a padding row (slot -1) reads a zero window
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        p = t - (K - 1) + j  # input position of tap j, relative to the sequence start
        xv = tl.load(X + (start + p)[:, None] * stride_x + c[None, :], mask=(tm & (p >= 0))[:, None] & cm[None, :], other=0.0)
        sv = tl.load(Pool + slot * stride_ps + (K - 1 + p)[:, None] * stride_pk + c[None, :], mask=(sm & (p < 0))[:, None] & cm[None, :], other=0.0)
        wj = tl.load(W + c * stride_wc + j * stride_wk, mask=cm, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(xv.dtype).to(tl.float32)) * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(Y + (start + t)[:, None] * stride_y + c[None, :], acc.to(Y.dtype.element_ty), mask=tm[:, None] & cm[None, :])


@triton.jit
def _window_row(X, base, start, n, i, stride_x, stride_pk, c, m, K: tl.constexpr):
    """Row n + i of the window [old state (K-1 rows); x (n rows)], as float32."""
    idx = n + i
    from_state = idx < K - 1
    sv = tl.load(base + idx * stride_pk + c, mask=m & from_state, other=0.0).to(tl.float32)
    xv = tl.load(X + (start + idx - (K - 1)) * stride_x + c, mask=m & (idx >= K - 1), other=0.0).to(tl.float32)
    return tl.where(from_state, sv, xv)


@triton.jit
def _conv_state_kernel(X, Pool, Slots, Cu, stride_x, stride_ps, stride_pk, C, K: tl.constexpr, BLOCK_C: tl.constexpr):
    """New state = the last K-1 rows of [old state; x], all rows read before any is written."""
    wait_for_previous_kernel()
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(Cu + s).to(tl.int64)
    n = tl.load(Cu + s + 1).to(tl.int64) - start
    slot = tl.load(Slots + s).to(tl.int64)
    m = tl.where(slot >= 0, c < C, False)
    base = Pool + slot * stride_ps
    pt = Pool.dtype.element_ty
    r0 = _window_row(X, base, start, n, 0, stride_x, stride_pk, c, m, K)
    if K >= 3:
        r1 = _window_row(X, base, start, n, 1, stride_x, stride_pk, c, m, K)
    if K >= 4:
        r2 = _window_row(X, base, start, n, 2, stride_x, stride_pk, c, m, K)
    tl.store(base + c, r0.to(pt), mask=m)
    if K >= 3:
        tl.store(base + stride_pk + c, r1.to(pt), mask=m)
    if K >= 4:
        tl.store(base + 2 * stride_pk + c, r2.to(pt), mask=m)


def causal_conv1d_varlen(x, weight, bias, conv_pool, slots, seq_lens, cu_seqlens=None, silu=True):
    T, C = x.shape
    K = weight.shape[1]
    assert 2 <= K <= 4, "the fused conv handles kernel widths 2..4"
    S = len(seq_lens)
    if cu_seqlens is None:
        cu_seqlens = cu_seqlens_of(seq_lens, x.device)
    y = torch.empty((T, C), dtype=x.dtype, device=x.device)
    if S == 0 or T == 0:
        return y
    bt, bc = 64, 128
    bias_arg = bias if bias is not None else weight
    _conv_varlen_kernel[(S, triton.cdiv(max(seq_lens), bt), triton.cdiv(C, bc))](
        x,
        weight,
        bias_arg,
        conv_pool,
        slots,
        cu_seqlens,
        y,
        *_conv_strides(x, weight, conv_pool),
        y.stride(0),
        C,
        K=K,
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_T=bt,
        BLOCK_C=bc,
        num_warps=4,
        **PDL_LAUNCH,
    )
    _conv_state_kernel[(S, triton.cdiv(C, 256))](
        x, conv_pool, slots, cu_seqlens, x.stride(0), conv_pool.stride(0), conv_pool.stride(1), C, K=K, BLOCK_C=256, num_warps=4, **PDL_LAUNCH
    )
    return y


@triton.jit
def _conv_verify_kernel(
    X,
    W,
    Bias,
    Pool,
    Slots,
    Y,
    stride_x,
    stride_wc,
    stride_wk,
    stride_ps,
    stride_pk,
    stride_y,
    C,
    Rows,
    Win,
    stride_rs,
    stride_ws,
    stride_wt,
    L,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """A verify step's conv (ops/verify.py:causal_conv1d_verify) for a block of channels of sequence
    s: its window rows written to Win[s] (the pool's K - 1, then each position's input), each
    position's silu(conv) (conv without SILU: LFM2's short conv) as a decode step computes it,
    stored at its flat row (a position past the sequence's length repeats its last row: not stored
    again). The pool is not written."""
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    slot = tl.load(Slots + s).to(tl.int64)
    s0, s1, s2, w0, w1, w2, w3 = conv_window(
        Pool + slot * stride_ps + c, stride_pk, W + c * stride_wc, stride_wk, cm, tl.where(slot >= 0, cm, False), K
    )
    bias = tl.load(Bias + c, mask=cm, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    wait_for_previous_kernel()
    win = Win + s * stride_ws + c
    wt = Win.dtype.element_ty
    tl.store(win, s0.to(wt), mask=cm)
    if K >= 3:
        tl.store(win + stride_wt, s1.to(wt), mask=cm)
    if K >= 4:
        tl.store(win + 2 * stride_wt, s2.to(wt), mask=cm)
    last = s * 0 - 1  # the flat row stored last (int64)
    for t in range(L):
        r = tl.load(Rows + s * stride_rs + t).to(tl.int64)
        x = tl.load(X + r * stride_x + c, mask=cm, other=0.0)
        tl.store(win + (K - 1 + t) * stride_wt, x.to(wt), mask=cm)
        y = conv_value(x, (s0, s1, s2, w0, w1, w2, w3), bias, K, SILU)
        tl.store(Y + r * stride_y + c, y.to(Y.dtype.element_ty), mask=tl.where(r != last, cm, False))
        last = r
        if K == 2:
            s0 = x.to(s0.dtype)
        elif K == 3:
            s0 = s1
            s1 = x.to(s1.dtype)
        else:
            s0 = s1
            s1 = s2
            s2 = x.to(s2.dtype)


def causal_conv1d_verify(x, weight, bias, conv_pool, slots, rows, flat, windows, silu=True):
    """`verify.causal_conv1d_verify` in one launch, over fixed [S, L] positions read from device
    memory (a verify graph can hold it); `flat` is implied by `rows`."""
    S, L = rows.shape
    T, C = x.shape
    K = weight.shape[1]
    assert 2 <= K <= 4, "the verify conv handles kernel widths 2..4"
    assert rows.stride(1) == 1 and windows.stride(2) == 1 and x.stride(1) == 1
    y = torch.empty((T, C), dtype=x.dtype, device=x.device)
    if S:
        block = 256
        _conv_verify_kernel[(S, triton.cdiv(C, block))](
            *_slot_conv_args(x, weight, bias, conv_pool, slots, y),
            rows,
            windows,
            rows.stride(0),
            windows.stride(0),
            windows.stride(1),
            L,
            K=K,
            HAS_BIAS=bias is not None,
            SILU=silu,
            BLOCK_C=block,
            num_warps=4,
            **PDL_LAUNCH,
        )
    return y
