"""Linear layers at decode batch sizes: a GEMV reading each weight row once for all rows of x (up
to LINEAR_GEMV_MAX_ROWS; with the conv update of Mamba2's in_proj in its epilogue), then a
tensor-core kernel (up to LINEAR_DOT_MAX_ROWS); cuBLAS above."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engram.ops.triton_ops.blocks import GEMV_CONFIG
from engram.ops.triton_ops.common import PDL_LAUNCH, as_rows, np2, precision, sm_count, wait_for_previous_kernel
from engram.ops.triton_ops.conv import conv_step, launch_conv_update


@triton.jit
def weight_block(W, n, nm, stride_w, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows n, columns k0..k0+BLOCK_K of a weight matrix (zeros outside it)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(W + n[:, None] * stride_w + kk[None, :], mask=nm[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def dot_rows(x_ptr, w_ptr, n, nm, stride_wn, w_first, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 W[n, :] . x for a block of rows n, given their first BLOCK_K columns `w_first`; the
    K loop is unrolled so that every weight load of the program is in flight at once."""
    acc = tl.zeros(n.shape, dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        w = w_first if k0 == 0 else weight_block(w_ptr, n, nm, stride_wn, k0, K, BLOCK_K)
        acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
    return acc


@triton.jit
def dot_tile(W, n, nm, stride_wn, k0, K, BLOCK_K: tl.constexpr):
    """W[n, k0:k0 + BLOCK_K]^T, the [BLOCK_K, n] weight operand of a `grouped_dot` step (zeros outside
    W), to read before the wait."""
    kk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(W + n[None, :] * stride_wn + kk[:, None], mask=nm[None, :] & (kk < K)[:, None], other=0.0)


@triton.jit
def first_dot(A, w0, a_rows, rv, stride_a, K, acc, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """acc + A[a_rows, :BLOCK_K] @ w0, for the first `dot_tile` w0 read early; `grouped_dot` from
    K0 = BLOCK_K does the rest."""
    kk = tl.arange(0, BLOCK_K)
    a = tl.load(A + a_rows[:, None] * stride_a + kk[None, :], mask=rv[:, None] & (kk < K)[None, :], other=0.0)
    return tl.dot(a, w0.to(a.dtype), acc, input_precision=PREC)


@triton.jit
def grouped_dot(A, W, a_rows, rv, n, nm, stride_a, stride_wn, K, acc, BLOCK_K: tl.constexpr, PREC: tl.constexpr, K0: tl.constexpr = 0):
    """acc + A[a_rows, K0:] @ W[n, K0:]^T: the rows of one block of tokens times one expert's rows n.
    (The loop reads its tiles itself: written with `dot_tile` it compiled to other code, BENCHMARKS.md.)"""
    for k0 in range(K0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        a = tl.load(A + a_rows[:, None] * stride_a + kk[None, :], mask=rv[:, None] & km[None, :], other=0.0)
        w = tl.load(W + n[None, :] * stride_wn + kk[:, None], mask=nm[None, :] & km[:, None], other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PREC)
    return acc


@triton.jit
def _row_rsqrt(Part, m, mm, stride_part, NPART, GS, eps, BLOCK_PART: tl.constexpr):
    """1 / sqrt(mean square + eps) of rows m, from the sums of squares of their parts (Part[m, :NPART],
    stored by the GATED SSD update), over GS values."""
    j = tl.arange(0, BLOCK_PART)
    part = tl.load(Part + m[:, None] * stride_part + j[None, :], mask=mm[:, None] & (j < NPART)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(part, axis=1) / GS + eps)


@triton.jit
def _gemv_kernel(
    X,
    W,
    B,
    Y,
    M,
    N,
    stride_x,
    stride_w,
    stride_y,
    CW,
    CB,
    Pool,
    Slots,
    conv_start,
    C,
    stride_wc,
    stride_wk,
    stride_ps,
    stride_pk,
    Part,
    stride_part,
    NPART,
    GS,
    eps,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CONV: tl.constexpr,
    CONV_K: tl.constexpr,
    CONV_BIAS: tl.constexpr,
    ROW_RSQRT: tl.constexpr,
    BLOCK_PART: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y = x W^T (+ b) for a few rows x, BLOCK_N output columns per program. With CONV, columns
    [conv_start, conv_start + C) are then replaced by their causal-conv update, row m being one
    token of the sequence at Slots[m] (Mamba2's in_proj and conv in one launch): each channel's
    window is read and shifted by the one program that owns the channel. With ROW_RSQRT, each row's
    x W^T is first scaled by `_row_rsqrt` (the gated norm's statistic of `ssd_state_update_norm_linear`)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, BLOCK_M)
    mm = m < M
    # The weights are constant: the first block of them is read while the previous kernel runs.
    w_first = weight_block(W, n, nm, stride_w, 0, K, BLOCK_K)
    wait_for_previous_kernel()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        w = (w_first if k0 == 0 else weight_block(W, n, nm, stride_w, k0, K, BLOCK_K)).to(tl.float32)
        xv = tl.load(X + m[:, None] * stride_x + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xv[:, None, :] * w[None, :, :], axis=2)
    if ROW_RSQRT:
        acc *= _row_rsqrt(Part, m, mm, stride_part, NPART, GS, eps, BLOCK_PART)[:, None]
    if HAS_BIAS:
        acc += tl.load(B + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    out = acc.to(Y.dtype.element_ty)
    if CONV:
        c = n - conv_start
        in_conv = (c >= 0) & (c < C)
        c = tl.where(in_conv, c, 0)
        slot = tl.load(Slots + m, mask=mm, other=-1).to(tl.int64)
        cm = mm[:, None] & in_conv[None, :]
        bias = tl.load(CB + c, mask=in_conv, other=0.0).to(tl.float32)[None, :] if CONV_BIAS else 0.0
        y = conv_step(
            out,
            Pool + slot[:, None] * stride_ps + c[None, :],
            stride_pk,
            CW + c[None, :] * stride_wc,
            stride_wk,
            bias,
            cm,
            cm & (slot >= 0)[:, None],
            CONV_K,
            True,  # Mamba2's SiLU
        )
        out = tl.where(in_conv[None, :], y.to(out.dtype), out)
    tl.store(Y + m[:, None] * stride_y + n[None, :], out, mask=mm[:, None] & nm[None, :])


@triton.jit
def _linear_dot_kernel(
    X,
    W,
    B,
    Y,
    M,
    N,
    stride_x,
    stride_w,
    stride_y,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
):
    """y = x W^T (+ b) for up to BLOCK_M rows on tensor cores (decode batches of a few dozen): one
    program per BLOCK_N output columns, all rows at once, so each weight is read once. (Reading the
    first weight tile before the wait made the batch-64 step 1.7% longer: BENCHMARKS.md.)"""
    wait_for_previous_kernel()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, BLOCK_M)
    mm = m < M
    acc = grouped_dot(X, W, m, mm, n, nm, stride_x, stride_w, K, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), BLOCK_K, PREC)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_y + n[None, :], acc.to(Y.dtype.element_ty), mask=mm[:, None] & nm[None, :])


# Rows of x up to which `linear` runs the GEMV above, and then the tensor-core kernel, instead of cuBLAS.
LINEAR_GEMV_MAX_ROWS = 4
LINEAR_DOT_MAX_ROWS = 64


# A single row (decode at batch 1) longer than this takes the GEMV's "linear_row_long_k" blocks
# (Mamba2's out_proj), a shorter one "linear_row"; 2-4 rows take "linear".
LINEAR_GEMV_LONG_K = 2048


def _small_linear_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return weight.stride(-1) == 1 and x.dtype == weight.dtype and (bias is None or bias.stride(-1) == 1)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    rows = x.numel() // x.shape[-1]
    return 0 < rows <= LINEAR_GEMV_MAX_ROWS and x.shape[-1] <= 16384 and _small_linear_operands(x, weight, bias)


def _linear_dot_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    rows = x.numel() // x.shape[-1]
    # tl.dot takes K blocks of 16 or more
    return LINEAR_GEMV_MAX_ROWS < rows <= LINEAR_DOT_MAX_ROWS and x.shape[-1] >= 16 and _small_linear_operands(x, weight, bias)


def _row_rsqrt_args(row_rsqrt: tuple | None, dummy: torch.Tensor) -> tuple[tuple, dict]:
    """The GEMV's (Part, stride_part, NPART, GS, eps) arguments and its ROW_RSQRT constexprs for
    `row_rsqrt` = (part [M, NPART] float32, GS, eps), or None."""
    part, gs, eps = row_rsqrt if row_rsqrt is not None else (dummy, 1.0, 0.0)
    args = (part, part.stride(0), part.shape[-1], gs, eps)
    return args, dict(ROW_RSQRT=row_rsqrt is not None, BLOCK_PART=np2(part.shape[-1]) if row_rsqrt is not None else 1)


def _gemv_config(rows: int, k: int) -> tuple[int, ...]:
    if rows == 1:
        return GEMV_CONFIG["linear_row_long_k" if k > LINEAR_GEMV_LONG_K else "linear_row"]
    return GEMV_CONFIG["linear"]


def gemv(x, weight, bias, conv=None, row_rsqrt=None):
    K = x.shape[-1]
    x2 = as_rows(x)
    M, N = x2.shape[0], weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    cw, cb, pool, slots, conv_start = conv if conv is not None else (weight, None, weight, weight, 0)
    rsqrt_args, rsqrt_flags = _row_rsqrt_args(row_rsqrt, weight)
    bn, bk, warps = _gemv_config(M, K)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        M,
        N,
        x2.stride(0),
        weight.stride(0),
        y.stride(0),
        cw,
        cb if cb is not None else cw,
        pool,
        slots,
        conv_start,
        cw.shape[0],
        cw.stride(0),
        cw.stride(-1),
        pool.stride(0),
        pool.stride(1),
        *rsqrt_args,
        K=K,
        HAS_BIAS=bias is not None,
        CONV=conv is not None,
        CONV_K=cw.shape[-1] if conv is not None else 0,
        CONV_BIAS=cb is not None,
        **rsqrt_flags,
        BLOCK_M=np2(M),
        BLOCK_N=bn,
        BLOCK_K=min(bk, np2(K)),
        num_warps=warps,
        **PDL_LAUNCH,
    )
    return y.view(*x.shape[:-1], N)


# A layer with at least this many output columns per SM takes the tensor-core kernel's "linear_dot"
# blocks, a narrower one "linear_dot_narrow" (up to 32 rows) or "linear_dot_narrow_64" (33-64 rows,
# BLOCK_M 64). On the H200 the latter's deeper pipeline made the batch-64 step 0.2% shorter; at 8 rows
# it was 0.5% slower, so the smaller batches keep theirs (BENCHMARKS.md).
LINEAR_DOT_WIDE_COLUMNS_PER_SM = 32


def linear_dot_config_key(n: int, rows: int, device: torch.device) -> str:
    """Which GEMV_CONFIG entry the tensor-core kernel takes for `rows` rows through a layer of n output columns."""
    if n >= LINEAR_DOT_WIDE_COLUMNS_PER_SM * sm_count(device):
        return "linear_dot"
    return "linear_dot_narrow_64" if rows > 32 else "linear_dot_narrow"


def _linear_dot(x, weight, bias):
    K = x.shape[-1]
    x2 = as_rows(x)
    M, N = x2.shape[0], weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = GEMV_CONFIG[linear_dot_config_key(N, M, x.device)]
    bk = bk * 2 // x.element_size()  # the blocks are tuned for 2-byte types: the same shared memory for float32
    _linear_dot_kernel[(triton.cdiv(N, bn),)](
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        M,
        N,
        x2.stride(0),
        weight.stride(0),
        y.stride(0),
        K=K,
        HAS_BIAS=bias is not None,
        BLOCK_M=max(16, np2(M)),
        BLOCK_N=bn,
        BLOCK_K=min(bk, np2(K)),
        PREC=precision(x),
        num_warps=warps,
        num_stages=stages,
        **PDL_LAUNCH,
    )
    return y.view(*x.shape[:-1], N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if gemv_applies(x, weight, bias):
        return gemv(x, weight, bias)
    if _linear_dot_applies(x, weight, bias):
        return _linear_dot(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_conv_update(x, weight, bias, conv_weight, conv_bias, conv_pool, slots, conv_start):
    """Up to LINEAR_GEMV_MAX_ROWS rows the conv update rides in the GEMV's epilogue; above, it is
    its own kernel after the projection (in the tensor-core kernel's accumulator layout its pool
    reads and writes would be scattered)."""
    if gemv_applies(x, weight, bias):
        assert 2 <= conv_weight.shape[1] <= 4, "the fused conv update handles kernel widths 2..4"
        return gemv(x, weight, bias, (conv_weight, conv_bias, conv_pool, slots, conv_start))
    proj = linear(x, weight, bias)
    xbc = proj[:, conv_start : conv_start + conv_weight.shape[0]]
    launch_conv_update(xbc, conv_weight, conv_bias, conv_pool, slots, xbc)  # in place: each element read, then written
    return proj
