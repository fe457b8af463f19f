"""RMS norms: alone, after the residual add, with a router's logits (the norm before a MoE), gated
(Mamba2); and SiLU-and-mul."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engram.ops import norm as norm_ref
from engram.ops.triton_ops.common import PDL_LAUNCH, as_rows, np2, sm_count, wait_for_previous_kernel


@triton.jit
def _normalize(x, w, N, eps, W_FP32: tl.constexpr):
    """RMS-normalize the row x (any float dtype) and apply w, rounding as the torch reference."""
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / N
    h = h * tl.rsqrt(var + eps)
    if W_FP32:
        return w.to(tl.float32) * h
    return w.to(tl.float32) * h.to(x.dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr, W_FP32: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0)  # weights: read before the wait
    wait_for_previous_kernel()
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + cols, _normalize(x, w, N, eps, W_FP32).to(Y.dtype.element_ty), mask=mask)


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False) -> torch.Tensor:
    n = x.shape[-1]
    x2 = as_rows(x)
    out_dtype = x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        block = np2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight,
            y,
            x2.stride(0),
            y.stride(0),
            n,
            eps,
            BLOCK=block,
            W_FP32=weight_in_fp32,
            num_warps=_norm_warps(block),
            **PDL_LAUNCH,
        )
    return y.view(*x.shape[:-1], n)


@triton.jit
def _add_and_normalize(X, R, w, RO, row, cols, mask, stride_x, stride_r, N, eps, scale, SCALED: tl.constexpr, W_FP32: tl.constexpr):
    """(stream, normalized) of one row: stream = R + X * scale in RO's dtype, then its RMS norm
    times the norm weight w (float32), with the torch reference's roundings."""
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if SCALED:
        x = (x.to(tl.float32) * scale).to(x.dtype)
    r = (tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32)).to(RO.dtype.element_ty)
    return r, _normalize(r.to(x.dtype), w, N, eps, W_FP32)


@triton.jit
def _add_rms_norm_kernel(
    X,
    R,
    W,
    Y,
    RO,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    N,
    eps,
    scale,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
    W_FP32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0)  # weights: read before the wait
    wait_for_previous_kernel()
    r, h = _add_and_normalize(X, R, w, RO, row, cols, mask, stride_x, stride_r, N, eps, scale, SCALED, W_FP32)
    tl.store(RO + row * stride_ro + cols, r, mask=mask)
    tl.store(Y + row * stride_y + cols, h.to(Y.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: float = 1.0, weight_in_fp32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2, r2 = as_rows(x), as_rows(residual)
    out_dtype = x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    r_out = torch.empty(r2.shape, dtype=torch.promote_types(residual.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        block = np2(n)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            y,
            r_out,
            x2.stride(0),
            r2.stride(0),
            y.stride(0),
            r_out.stride(0),
            n,
            eps,
            float(scale),
            SCALED=scale != 1.0,
            BLOCK=block,
            W_FP32=weight_in_fp32,
            num_warps=_norm_warps(block),
            **PDL_LAUNCH,
        )
    return y.view(*x.shape[:-1], n), r_out.view(*residual.shape[:-1], n)


@triton.jit
def _add_rms_norm_linear_kernel(
    X,
    R,
    W,
    Y,
    RO,
    L,
    Out,
    T,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    stride_l,
    stride_o,
    N,
    NL,
    eps,
    scale,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    TOKENS: tl.constexpr,
):
    """Programs (TOKENS tokens, block of ROWS output features): each normalizes its tokens' rows (as
    `_add_rms_norm_kernel`; the programs of the first feature block store them and the stream) and
    applies its ROWS rows of the linear layer to them, so the weight loads of all programs are in
    flight at once (issued before the wait, with the norm's)."""
    j = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    jm = j < NL
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    lw = tl.load(L + j[:, None] * stride_l + cols[None, :], mask=jm[:, None] & mask[None, :], other=0.0)
    w = tl.load(W + cols, mask=mask, other=0.0)
    wait_for_previous_kernel()
    for i in tl.static_range(TOKENS):
        row = tl.program_id(0).to(tl.int64) * TOKENS + i
        if row < T:
            r, h = _add_and_normalize(X, R, w, RO, row, cols, mask, stride_x, stride_r, N, eps, scale, SCALED, False)
            h = h.to(Y.dtype.element_ty)
            if tl.program_id(1) == 0:
                tl.store(RO + row * stride_ro + cols, r, mask=mask)
                tl.store(Y + row * stride_y + cols, h, mask=mask)
            out = tl.sum(lw.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
            tl.store(Out + row * stride_o + j, out.to(Out.dtype.element_ty), mask=jm)


# Output features up to which `add_rms_norm_linear` runs the fused kernel (a router; not a projection).
NORM_LINEAR_MAX_FEATURES = 512
# With at least this many programs per SM at twice the rows, each program takes twice the rows for two
# tokens. On the H200 at Granite-4.0-H-tiny's 64 experts and 64 tokens: 8 rows for one token (512
# programs of 210 registers a thread: 2 per SM, two waves) gave a 0.8% shorter decode step than 4 rows;
# 8 rows for two tokens (256 programs, one wave) 0.5% shorter again. 32 tokens: 4 rows either way; 8
# tokens: 8 rows 6% longer.
NORM_LINEAR_PROGRAMS_PER_SM = 3


def _norm_linear_tile(tokens: int, features: int, block: int, device: torch.device) -> tuple[int, int]:
    """(rows of the linear layer, tokens) per program: a [rows, hidden] tile of 8,192 weights for one
    token, or twice the rows for two tokens."""
    rows = max(1, 8192 // block)
    if tokens * triton.cdiv(features, 2 * rows) >= NORM_LINEAR_PROGRAMS_PER_SM * sm_count(device):
        return rows * 2, 2
    return rows, 1


def add_rms_norm_linear(x, residual, weight, eps, scale, linear_weight):
    nl, n = linear_weight.shape
    if nl > NORM_LINEAR_MAX_FEATURES or linear_weight.stride(-1) != 1 or weight.dtype != x.dtype or linear_weight.dtype != x.dtype:
        return norm_ref.add_rms_norm_linear(x, residual, weight, eps, scale, linear_weight)
    x2, r2 = as_rows(x), as_rows(residual)
    T = x2.shape[0]
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r_out = torch.empty(r2.shape, dtype=torch.promote_types(residual.dtype, x.dtype), device=x.device)
    out = torch.empty((T, nl), dtype=x.dtype, device=x.device)
    if T:
        block = np2(n)
        rows, tokens = _norm_linear_tile(T, nl, block, x.device)
        _add_rms_norm_linear_kernel[(triton.cdiv(T, tokens), triton.cdiv(nl, rows))](
            x2,
            r2,
            weight,
            y,
            r_out,
            linear_weight,
            out,
            T,
            x2.stride(0),
            r2.stride(0),
            y.stride(0),
            r_out.stride(0),
            linear_weight.stride(0),
            out.stride(0),
            n,
            nl,
            eps,
            float(scale),
            SCALED=scale != 1.0,
            BLOCK=block,
            ROWS=rows,
            TOKENS=tokens,
            num_warps=min(16, max(4, block // 512)),
            **PDL_LAUNCH,
        )
    return y.view(*x.shape[:-1], n), r_out.view(*residual.shape[:-1], n), out.view(*x.shape[:-1], nl)


@triton.jit
def _gated_rms_norm_kernel(X, Z, W, Y, stride_x, stride_z, stride_y, GS, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    off = tl.program_id(1) * GS + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < GS
    w = tl.load(W + off, mask=mask, other=0.0).to(tl.float32)  # weights: read before the wait
    wait_for_previous_kernel()
    x = tl.load(X + row * stride_x + off, mask=mask, other=0.0)
    z = tl.load(Z + row * stride_z + off, mask=mask, other=0.0).to(tl.float32)
    h = x.to(tl.float32) * (z * tl.sigmoid(z))
    var = tl.sum(h * h, axis=0) / GS
    h = h * tl.rsqrt(var + eps)
    y = w * h.to(x.dtype).to(tl.float32)
    tl.store(Y + row * stride_y + off, y.to(Y.dtype.element_ty), mask=mask)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    n = x.shape[-1]
    x2, z2 = as_rows(x), as_rows(gate)
    dtype = out_dtype or torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, dtype=dtype, device=x.device)
    if x2.shape[0]:
        block = np2(group_size)
        _gated_rms_norm_kernel[(x2.shape[0], n // group_size)](
            x2,
            z2,
            weight,
            y,
            x2.stride(0),
            z2.stride(0),
            y.stride(0),
            group_size,
            eps,
            BLOCK=block,
            num_warps=_norm_warps(block),
            **PDL_LAUNCH,
        )
    return y.view(*x.shape[:-1], n)


@triton.jit
def _silu_and_mul_kernel(H, Y, stride_h, stride_y, N, BLOCK: tl.constexpr):
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(H + row * stride_h + cols, mask=mask, other=0.0)
    u = tl.load(H + row * stride_h + N + cols, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    s = (gf * tl.sigmoid(gf)).to(g.dtype).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (s * u).to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    n = h.shape[-1] // 2
    h2 = h.reshape(-1, 2 * n)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    y = torch.empty((h2.shape[0], n), dtype=h.dtype, device=h.device)
    if h2.shape[0]:
        block = min(1024, np2(n))
        _silu_and_mul_kernel[(h2.shape[0], triton.cdiv(n, block))](h2, y, h2.stride(0), y.stride(0), n, BLOCK=block, num_warps=4, **PDL_LAUNCH)
    return y.view(*h.shape[:-1], n)
