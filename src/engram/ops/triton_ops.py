"""Triton kernels for the CUDA fast path. Each function here has the signature and semantics of the
torch reference of the same name (engram.ops.{conv,ssd,norm,activation,attention,moe}); tests/
test_gpu_ops.py compares them on random inputs.

Kernels that touch recurrent state read and write the pools in place by slot; a slot of -1 (and a
context length of -1 in attention) marks a padding row of a CUDA-graph batch, which reads and
writes nothing. None of these ops syncs with the host or has data-dependent output shapes, so a
decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engram.ops import moe as moe_ref
from engram.ops import norm as norm_ref
from engram.ops import sample as sample_ref

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _np2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _precision(t: torch.Tensor) -> str:
    """Dot precision: exact float32 for float32 inputs (tests), native for half types."""
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _pdl_supported() -> bool:
    """Hopper or later, not Triton's CPU interpreter, not turned off with ENGRAM_DISABLE_PDL=1."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("ENGRAM_DISABLE_PDL") == "1" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


# Programmatic dependent launch (Hopper and later): every kernel here is launched while the one
# before it drains, so that the launch of each small kernel of a decode step overlaps the tail of
# the previous one. A kernel waits for the one before it (griddepcontrol.wait: it is complete and
# its writes are visible) before it writes anything or reads what that kernel may write. Before the
# wait it may read what the kernel just before it does not write: every earlier kernel is complete
# once every program of that one has passed its own wait, which is when the next one is let in.
# Read so: model weights (the GEMVs' first blocks, the norms' and the router's weights), the SSD
# update's state and parameters, and the MoE down projection's routing (from the top-k kernel, two
# launches back). The grouped MoE up projection's shared-expert programs compute their whole tile
# (their input is from before the routing) and wait only to store it.
PDL = tl.constexpr(_pdl_supported())
_PDL_LAUNCH = {"launch_pdl": True} if PDL else {}


@triton.jit
def _wait_for_previous_kernel():
    if PDL:
        gdc_wait()
        gdc_launch_dependents()  # the next kernel may be scheduled once every program got here


# ---------------------------------------------------------------------------------------------
# norms and activations


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
    _wait_for_previous_kernel()
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + cols, _normalize(x, w, N, eps, W_FP32).to(Y.dtype.element_ty), mask=mask)


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False) -> torch.Tensor:
    n = x.shape[-1]
    x2 = _rows(x)
    out_dtype = x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        block = _np2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, y, x2.stride(0), y.stride(0), n, eps, BLOCK=block, W_FP32=weight_in_fp32, num_warps=_norm_warps(block), **_PDL_LAUNCH,
        )
    return y.view(*x.shape[:-1], n)


@triton.jit
def _add_and_normalize(X, R, w, RO, row, cols, mask, stride_x, stride_r, N, eps, scale,
                       SCALED: tl.constexpr, W_FP32: tl.constexpr):
    """(stream, normalized) of one row: stream = R + X * scale in RO's dtype, then its RMS norm
    times the norm weight w (float32), with the torch reference's roundings."""
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if SCALED:
        x = (x.to(tl.float32) * scale).to(x.dtype)
    r = (tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32)).to(RO.dtype.element_ty)
    return r, _normalize(r.to(x.dtype), w, N, eps, W_FP32)


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, Y, RO, stride_x, stride_r, stride_y, stride_ro, N, eps, scale,
    SCALED: tl.constexpr, BLOCK: tl.constexpr, W_FP32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0)  # weights: read before the wait
    _wait_for_previous_kernel()
    r, h = _add_and_normalize(X, R, w, RO, row, cols, mask, stride_x, stride_r, N, eps, scale, SCALED, W_FP32)
    tl.store(RO + row * stride_ro + cols, r, mask=mask)
    tl.store(Y + row * stride_y + cols, h.to(Y.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: float = 1.0, weight_in_fp32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2, r2 = _rows(x), _rows(residual)
    out_dtype = x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    r_out = torch.empty(r2.shape, dtype=torch.promote_types(residual.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        block = _np2(n)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, y, r_out, x2.stride(0), r2.stride(0), y.stride(0), r_out.stride(0), n, eps, float(scale),
            SCALED=scale != 1.0, BLOCK=block, W_FP32=weight_in_fp32, num_warps=_norm_warps(block), **_PDL_LAUNCH,
        )
    return y.view(*x.shape[:-1], n), r_out.view(*residual.shape[:-1], n)


@triton.jit
def _add_rms_norm_linear_kernel(
    X, R, W, Y, RO, L, Out, stride_x, stride_r, stride_y, stride_ro, stride_l, stride_o, N, NL, eps, scale,
    SCALED: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    """Programs (token, block of ROWS output features): each normalizes its token's row (as
    `_add_rms_norm_kernel`; the first program of the token stores it and the stream) and applies
    its ROWS rows of the linear layer to it, so the weight loads of all programs are in flight at once
    (issued before the wait, with the norm's)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    jm = j < NL
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    lw = tl.load(L + j[:, None] * stride_l + cols[None, :], mask=jm[:, None] & mask[None, :], other=0.0)
    w = tl.load(W + cols, mask=mask, other=0.0)
    _wait_for_previous_kernel()
    r, h = _add_and_normalize(X, R, w, RO, row, cols, mask, stride_x, stride_r, N, eps, scale, SCALED, False)
    h = h.to(Y.dtype.element_ty)
    if tl.program_id(1) == 0:
        tl.store(RO + row * stride_ro + cols, r, mask=mask)
        tl.store(Y + row * stride_y + cols, h, mask=mask)
    out = tl.sum(lw.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
    tl.store(Out + row * stride_o + j, out.to(Out.dtype.element_ty), mask=jm)


# Output features up to which `add_rms_norm_linear` runs the fused kernel (a router; not a projection).
NORM_LINEAR_MAX_FEATURES = 512


def add_rms_norm_linear(x, residual, weight, eps, scale, linear_weight):
    nl, n = linear_weight.shape
    if nl > NORM_LINEAR_MAX_FEATURES or linear_weight.stride(-1) != 1 or weight.dtype != x.dtype or linear_weight.dtype != x.dtype:
        return norm_ref.add_rms_norm_linear(x, residual, weight, eps, scale, linear_weight)
    x2, r2 = _rows(x), _rows(residual)
    T = x2.shape[0]
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r_out = torch.empty(r2.shape, dtype=torch.promote_types(residual.dtype, x.dtype), device=x.device)
    out = torch.empty((T, nl), dtype=x.dtype, device=x.device)
    if T:
        block = _np2(n)
        rows = max(1, 8192 // block)  # a [rows, hidden] tile of the weight per program
        _add_rms_norm_linear_kernel[(T, triton.cdiv(nl, rows))](
            x2, r2, weight, y, r_out, linear_weight, out, x2.stride(0), r2.stride(0), y.stride(0), r_out.stride(0),
            linear_weight.stride(0), out.stride(0), n, nl, eps, float(scale), SCALED=scale != 1.0, BLOCK=block, ROWS=rows,
            num_warps=min(16, max(4, block // 512)), **_PDL_LAUNCH,
        )
    return y.view(*x.shape[:-1], n), r_out.view(*residual.shape[:-1], n), out.view(*x.shape[:-1], nl)


@triton.jit
def _gated_rms_norm_kernel(X, Z, W, Y, stride_x, stride_z, stride_y, GS, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    off = tl.program_id(1) * GS + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < GS
    w = tl.load(W + off, mask=mask, other=0.0).to(tl.float32)  # weights: read before the wait
    _wait_for_previous_kernel()
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
    x2, z2 = _rows(x), _rows(gate)
    dtype = out_dtype or torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, dtype=dtype, device=x.device)
    if x2.shape[0]:
        block = _np2(group_size)
        _gated_rms_norm_kernel[(x2.shape[0], n // group_size)](
            x2, z2, weight, y, x2.stride(0), z2.stride(0), y.stride(0), group_size, eps, BLOCK=block,
            num_warps=_norm_warps(block), **_PDL_LAUNCH,
        )
    return y.view(*x.shape[:-1], n)


@triton.jit
def _silu_and_mul_kernel(H, Y, stride_h, stride_y, N, BLOCK: tl.constexpr):
    _wait_for_previous_kernel()
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
        block = min(1024, _np2(n))
        _silu_and_mul_kernel[(h2.shape[0], triton.cdiv(n, block))](h2, y, h2.stride(0), y.stride(0), n, BLOCK=block, num_warps=4, **_PDL_LAUNCH)
    return y.view(*h.shape[:-1], n)


# ---------------------------------------------------------------------------------------------
# causal conv1d (Mamba2's short convolution), state in the pool [slots, K-1, C]


# Each thread owns whole channels: every state row is a 1-D vector over the same channels, loaded
# before any row is stored, so the in-place shift has no cross-thread hazard. K <= 4 (Mamba2 uses 4).


@triton.jit
def _conv_step(x, state, stride_pk, w, stride_wk, bias, m, sm, K: tl.constexpr):
    """One token of the causal conv, elementwise over any block of (sequence, channel) entries:
    `state` points at row 0 of each entry's window in the pool, `w` at its weight row; masks `m`
    (channel valid) and `sm` (and a state to touch). Returns silu(conv) in float32 and shifts the
    window in place (every row is loaded before any is stored)."""
    xdt = x.dtype
    s0 = tl.load(state, mask=sm, other=0.0).to(xdt).to(tl.float32)
    acc = s0 * tl.load(w, mask=m, other=0.0).to(tl.float32)
    if K >= 3:
        s1 = tl.load(state + stride_pk, mask=sm, other=0.0).to(xdt).to(tl.float32)
        acc += s1 * tl.load(w + stride_wk, mask=m, other=0.0).to(tl.float32)
    if K >= 4:
        s2 = tl.load(state + 2 * stride_pk, mask=sm, other=0.0).to(xdt).to(tl.float32)
        acc += s2 * tl.load(w + 2 * stride_wk, mask=m, other=0.0).to(tl.float32)
    acc += x.to(tl.float32) * tl.load(w + (K - 1) * stride_wk, mask=m, other=0.0).to(tl.float32)
    acc += bias
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
    return acc * tl.sigmoid(acc)


@triton.jit
def _conv_update_kernel(
    X, W, Bias, Pool, Slots, Y,
    stride_x, stride_wc, stride_wk, stride_ps, stride_pk, stride_y, C,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    _wait_for_previous_kernel()
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    slot = tl.load(Slots + s).to(tl.int64)
    x = tl.load(X + s * stride_x + c, mask=cm, other=0.0)
    bias = tl.load(Bias + c, mask=cm, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    y = _conv_step(x, Pool + slot * stride_ps + c, stride_pk, W + c * stride_wc, stride_wk, bias, cm, cm & (slot >= 0), K)
    tl.store(Y + s * stride_y + c, y.to(Y.dtype.element_ty), mask=cm)


def _launch_conv_update(x, weight, bias, conv_pool, slots, y):
    S, C = x.shape
    K = weight.shape[1]
    assert 2 <= K <= 4, "the fused conv update handles kernel widths 2..4"
    if S:
        block = 256
        _conv_update_kernel[(S, triton.cdiv(C, block))](
            x, weight, bias if bias is not None else weight, conv_pool, slots, y,
            x.stride(0), weight.stride(0), weight.stride(1), conv_pool.stride(0), conv_pool.stride(1), y.stride(0), C,
            K=K, HAS_BIAS=bias is not None, BLOCK_C=block, num_warps=4, **_PDL_LAUNCH
        )
    return y


@triton.jit
def _conv_varlen_kernel(
    X, W, Bias, Pool, Slots, Cu, Y,
    stride_x, stride_wc, stride_wk, stride_ps, stride_pk, stride_y, C,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    _wait_for_previous_kernel()
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
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        p = t - (K - 1) + j  # input position of tap j, relative to the sequence start
        xv = tl.load(X + (start + p)[:, None] * stride_x + c[None, :], mask=(tm & (p >= 0))[:, None] & cm[None, :], other=0.0)
        sv = tl.load(
            Pool + slot * stride_ps + (K - 1 + p)[:, None] * stride_pk + c[None, :], mask=(tm & (p < 0))[:, None] & cm[None, :], other=0.0
        )
        wj = tl.load(W + c * stride_wc + j * stride_wk, mask=cm, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(xv.dtype).to(tl.float32)) * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(Y + (start + t)[:, None] * stride_y + c[None, :], y.to(Y.dtype.element_ty), mask=tm[:, None] & cm[None, :])


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
    _wait_for_previous_kernel()
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(Cu + s).to(tl.int64)
    n = tl.load(Cu + s + 1).to(tl.int64) - start
    slot = tl.load(Slots + s).to(tl.int64)
    m = (c < C) & (slot >= 0)
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


def _cu_seqlens(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int64, device=device)


def causal_conv1d_varlen(x, weight, bias, conv_pool, slots, seq_lens, cu_seqlens=None):
    T, C = x.shape
    K = weight.shape[1]
    assert 2 <= K <= 4, "the fused conv handles kernel widths 2..4"
    S = len(seq_lens)
    if cu_seqlens is None:
        cu_seqlens = _cu_seqlens(seq_lens, x.device)
    y = torch.empty((T, C), dtype=x.dtype, device=x.device)
    if S == 0 or T == 0:
        return y
    bt, bc = 64, 128
    bias_arg = bias if bias is not None else weight
    _conv_varlen_kernel[(S, triton.cdiv(max(seq_lens), bt), triton.cdiv(C, bc))](
        x, weight, bias_arg, conv_pool, slots, cu_seqlens, y,
        x.stride(0), weight.stride(0), weight.stride(1), conv_pool.stride(0), conv_pool.stride(1), y.stride(0), C,
        K=K, HAS_BIAS=bias is not None, BLOCK_T=bt, BLOCK_C=bc, num_warps=4, **_PDL_LAUNCH
    )
    _conv_state_kernel[(S, triton.cdiv(C, 256))](
        x, conv_pool, slots, cu_seqlens, x.stride(0), conv_pool.stride(0), conv_pool.stride(1), C, K=K, BLOCK_C=256, num_warps=4, **_PDL_LAUNCH
    )
    return y


# ---------------------------------------------------------------------------------------------
# SSD single-token state update, state in the pool [slots, H, P, N]


@triton.jit
def _ssd_tile(Pool, Slots, s, stride_ps, stride_ph, stride_pp, P, N, HPG, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (head, P block) of sequence s's state in the pool: head, group, the P and N
    offsets with their masks, the state's pointers and mask (nothing for a padding slot -1)."""
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm = p < P
    nm = n < N
    slot = tl.load(Slots + s).to(tl.int64)
    ptr = Pool + slot * stride_ps + h * stride_ph + p[:, None] * stride_pp + n[None, :]
    return h, h // HPG, p, n, pm, nm, ptr, pm[:, None] & nm[None, :] & (slot >= 0)


@triton.jit
def _ssd_dt(dt, dt_bias, dt_min, dt_max):
    """softplus(dt + dt_bias) (threshold 20, as torch), clamped to the time-step limit."""
    dt = dt + dt_bias
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
    return tl.minimum(tl.maximum(dt, dt_min), dt_max)


@triton.jit
def _ssd_update_kernel(
    Pool, Slots, X, DT, DtBias, ALog, Bm, Cm, Dp, Y,
    stride_ps, stride_ph, stride_pp, stride_xs, stride_xh, stride_dts, stride_bs, stride_bg, stride_cs, stride_cg,
    stride_ys, stride_yh, P, N, HPG, dt_min, dt_max,
    Z, NormW, Part, stride_zs, stride_part,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr,
):
    """GATED: instead of y, store norm_weight * y * silu(z) and this program's sum of (y * silu(z))^2
    in Part[s, program]: the gated RMS norm without its row statistic, which the output projection
    applies (`_row_rsqrt`)."""
    s = tl.program_id(0).to(tl.int64)
    h, g, p, n, pm, nm, ptr, m2 = _ssd_tile(Pool, Slots, s, stride_ps, stride_ph, stride_pp, P, N, HPG, BLOCK_P, BLOCK_N)
    # Read before the wait: the state (the previous kernel, in_proj or the conv update, does not
    # write it) and the parameters. x, dt, B and C come from the previous kernel.
    st = tl.load(ptr, mask=m2, other=0.0).to(tl.float32)
    dt_bias = tl.load(DtBias + h).to(tl.float32)
    A = -tl.exp(tl.load(ALog + h).to(tl.float32))
    Dh = tl.load(Dp + h).to(tl.float32)
    if GATED:
        nw = tl.load(NormW + h * P + p, mask=pm, other=0.0).to(tl.float32)
    _wait_for_previous_kernel()
    dt = _ssd_dt(tl.load(DT + s * stride_dts + h).to(tl.float32), dt_bias, dt_min, dt_max)
    x = tl.load(X + s * stride_xs + h * stride_xh + p, mask=pm, other=0.0).to(tl.float32)
    b = tl.load(Bm + s * stride_bs + g * stride_bg + n, mask=nm, other=0.0).to(tl.float32)
    c = tl.load(Cm + s * stride_cs + g * stride_cg + n, mask=nm, other=0.0).to(tl.float32)
    st = st * tl.exp(dt * A) + (x * dt)[:, None] * b[None, :]
    tl.store(ptr, st.to(Pool.dtype.element_ty), mask=m2)
    y = tl.sum(st * c[None, :], axis=1) + x * Dh
    if GATED:
        z = tl.load(Z + s * stride_zs + h * P + p, mask=pm, other=0.0).to(tl.float32)
        y = y * (z * tl.sigmoid(z))
        program = h * tl.num_programs(2) + tl.program_id(2)
        tl.store(Part + s * stride_part + program, tl.sum(y * y, axis=0))
        y = nw * y
    tl.store(Y + s * stride_ys + h * stride_yh + p, y.to(Y.dtype.element_ty), mask=pm)


def _ssd_strides(ssm_pool, x, dt, B, C, y, dt_limit) -> tuple:
    """The stride, size and dt-limit arguments both SSD kernels take, in their order."""
    return (
        ssm_pool.stride(0), ssm_pool.stride(1), ssm_pool.stride(2), x.stride(0), x.stride(1), dt.stride(0),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1), y.stride(0), y.stride(1), x.shape[2], B.shape[2],
        x.shape[1] // B.shape[1], float(dt_limit[0]), float(dt_limit[1]),
    )


def _ssd_update_block_p(head_dim: int) -> int:
    """BLOCK_P of the SSD update: programs of 8 rows of a head's state (`h200-ssd-update-blocks.log`)."""
    return min(8, _np2(head_dim))


def _launch_ssd_update(ssm_pool, slots, x, dt, dt_bias, dt_limit, A_log, B, C, D, y, gated=None):
    """`gated`: (gate, norm_weight, part) for the GATED variant of the kernel, y then [S, H * P]."""
    S, H, P = x.shape
    bp = _ssd_update_block_p(P)
    z, norm_weight, part = gated if gated is not None else (y, y, y)
    _ssd_update_kernel[(S, H, triton.cdiv(P, bp))](
        ssm_pool, slots, x, dt, dt_bias, A_log, B, C, D, y, *_ssd_strides(ssm_pool, x, dt, B, C, y.view(S, H, P), dt_limit),
        z, norm_weight, part, z.stride(0), part.stride(0), BLOCK_P=bp, BLOCK_N=_np2(B.shape[2]), GATED=gated is not None,
        num_warps=2, **_PDL_LAUNCH
    )


def ssd_state_update(ssm_pool, slots, x, dt, dt_bias, dt_limit, A_log, B, C, D):
    assert x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1 and ssm_pool.stride(3) == 1
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _launch_ssd_update(ssm_pool, slots, x, dt, dt_bias, dt_limit, A_log, B, C, D, y)
    return y


# Each program of the out_proj GEMV loads all of a row's parts (sums of squares): 384 for
# Granite-4.0-H-tiny, where the fusion was measured. Rows of more parts take the three kernels.
SSD_NORM_MAX_PARTS = 512


def ssd_state_update_norm_linear(
    ssm_pool, slots, x, dt, dt_bias, dt_limit, A_log, B, C, D, gate, norm_weight, eps, group_size, weight, bias=None
):
    """With one norm group over the whole row and the GEMV's batch sizes, the gated norm has no launch
    of its own: the SSD update stores norm_weight * y * silu(gate) and per-program sums of squares,
    and the output projection's GEMV scales each row's dot products by the rsqrt of the row's mean
    square. The rounding differs from the reference's (normalize, round, scale by the weight, round,
    project) in the order of one rounding. Otherwise, the three kernels one after another (the same
    scaling in the tensor-core kernel was slower at batches 8 and 64: BENCHMARKS.md)."""
    S, H, P = x.shape
    parts = H * triton.cdiv(P, _ssd_update_block_p(P))
    # the gate has the shape of the projection's input, and its dtype when the GEMV applies
    fused = _gemv_applies(gate, weight, bias) and group_size == H * P and parts <= SSD_NORM_MAX_PARTS
    if not (fused and weight.dtype in (torch.bfloat16, torch.float32) and gate.stride(-1) == 1):
        y = ssd_state_update(ssm_pool, slots, x, dt, dt_bias, dt_limit, A_log, B, C, D)
        return linear(gated_rms_norm(y.view(S, H * P), gate, norm_weight, eps, group_size, weight.dtype), weight, bias)
    assert x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1 and ssm_pool.stride(3) == 1
    u = torch.empty((S, H * P), dtype=weight.dtype, device=x.device)
    part = torch.empty((S, parts), dtype=torch.float32, device=x.device)
    _launch_ssd_update(ssm_pool, slots, x, dt, dt_bias, dt_limit, A_log, B, C, D, u, (gate, norm_weight, part))
    return _gemv(u, weight, bias, row_rsqrt=(part, float(group_size), float(eps)))


@triton.jit
def _ssd_scan_kernel(
    Pool, Slots, Cu, X, DT, DtBias, ALog, Bm, Cm, Dp, Y,
    stride_ps, stride_ph, stride_pp, stride_xt, stride_xh, stride_dtt, stride_bt, stride_bg, stride_ct, stride_cg,
    stride_yt, stride_yh, P, N, HPG, dt_min, dt_max,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The SSD recurrence token by token over each sequence of a flat batch, state in registers
    (read from and written back to the pool by slot). For short prefill chunks: one launch, exact."""
    _wait_for_previous_kernel()
    s = tl.program_id(0).to(tl.int64)
    h, g, p, n, pm, nm, ptr, m2 = _ssd_tile(Pool, Slots, s, stride_ps, stride_ph, stride_pp, P, N, HPG, BLOCK_P, BLOCK_N)
    start = tl.load(Cu + s)
    end = tl.load(Cu + s + 1)
    st = tl.load(ptr, mask=m2, other=0.0).to(tl.float32)
    dtb = tl.load(DtBias + h).to(tl.float32)
    A = -tl.exp(tl.load(ALog + h).to(tl.float32))
    Dh = tl.load(Dp + h).to(tl.float32)
    for t in range(start, end):
        dt = _ssd_dt(tl.load(DT + t * stride_dtt + h).to(tl.float32), dtb, dt_min, dt_max)
        x = tl.load(X + t * stride_xt + h * stride_xh + p, mask=pm, other=0.0).to(tl.float32)
        b = tl.load(Bm + t * stride_bt + g * stride_bg + n, mask=nm, other=0.0).to(tl.float32)
        c = tl.load(Cm + t * stride_ct + g * stride_cg + n, mask=nm, other=0.0).to(tl.float32)
        st = st * tl.exp(dt * A) + (x * dt)[:, None] * b[None, :]
        y = tl.sum(st * c[None, :], axis=1) + x * Dh
        tl.store(Y + t * stride_yt + h * stride_yh + p, y, mask=pm)
    tl.store(ptr, st.to(Pool.dtype.element_ty), mask=m2)


# Sequences up to this long take the token-by-token scan (one launch, little host work); longer
# prefills take the chunked kernels (fla-core).
SSD_SCAN_MAX_LEN = 128


def ssd_varlen_scan(x, dt, dt_bias, dt_limit, A_log, B, C, D, chunk_size, seq_lens, ssm_pool, slots, cu_seqlens=None):
    """`ssd.ssd_varlen` by the recurrence itself (fast for short sequences)."""
    T, H, P = x.shape
    N = B.shape[2]
    S = len(seq_lens)
    y = torch.empty((T, H, P), dtype=torch.float32, device=x.device)
    if S == 0 or T == 0:
        return y
    if cu_seqlens is None:
        cu_seqlens = _cu_seqlens(seq_lens, x.device)
    assert x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1 and ssm_pool.stride(3) == 1
    bp = min(16, _np2(P))
    _ssd_scan_kernel[(S, H, triton.cdiv(P, bp))](
        ssm_pool, slots, cu_seqlens, x, dt, dt_bias, A_log, B, C, D, y, *_ssd_strides(ssm_pool, x, dt, B, C, y, dt_limit),
        BLOCK_P=bp, BLOCK_N=_np2(N), num_warps=4, **_PDL_LAUNCH
    )
    return y


# ---------------------------------------------------------------------------------------------
# paged attention (prefill chunks with context, and decode), GQA folded into the row dimension


@triton.jit
def _paged_attention_kernel(
    Q, Kc, Vc, O, BT, Cu, Ctx, PSeq, PQs,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_bs, stride_bp,
    scale, D,
    G: tl.constexpr, TPB: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DECODE: tl.constexpr, PREC: tl.constexpr, NSPLIT: tl.constexpr, Part, PartML, Hq,
):
    _wait_for_previous_kernel()
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    if DECODE:
        seq = pid.to(tl.int64)
        qs = 0
    else:
        seq = tl.load(PSeq + pid).to(tl.int64)
        qs = tl.load(PQs + pid)
    q0 = tl.load(Cu + seq)
    n = tl.load(Cu + seq + 1) - q0
    ctx = tl.load(Ctx + seq)
    rows = tl.arange(0, BLOCK_M)
    tok = qs + rows // G
    head = kvh * G + rows % G
    rv = (rows < TPB * G) & (tok < n)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(Q + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=rv[:, None] & dm[None, :], other=0.0)
    qpos = ctx + tok
    hi = tl.minimum(ctx + n, ctx + qs + TPB)
    lo = 0
    if NSPLIT > 1:  # this program takes one of NSPLIT consecutive ranges of the keys
        split = tl.program_id(2)
        per = tl.cdiv(tl.cdiv(hi, NSPLIT), BLOCK_N) * BLOCK_N
        lo = split * per
        hi = tl.minimum(hi, lo + per)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pv = pos < hi
        page = tl.load(BT + seq * stride_bs + (pos // PAGE) * stride_bp, mask=pv, other=0).to(tl.int64)
        slot = page * PAGE + pos % PAGE
        k = tl.load(Kc + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=pv[:, None] & dm[None, :], other=0.0)
        sc = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * scale
        ok = pv[None, :] & (pos[None, :] <= qpos[:, None])
        sc = tl.where(ok, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(sc - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(Vc + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=pv[:, None] & dm[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PREC)
        m_i = m_new
    if NSPLIT > 1:  # partial results: unnormalized acc, running max and sum, per (split, token, head)
        row = (q0 + tok).to(tl.int64) * Hq + head
        base = tl.program_id(2).to(tl.int64) * stride_ot  # stride_ot = rows of a split (T * Hq)
        tl.store(Part + (base + row)[:, None] * BLOCK_D + d[None, :], acc, mask=rv[:, None])
        tl.store(PartML + (base + row) * 2, m_i, mask=rv)
        tl.store(PartML + (base + row) * 2 + 1, l_i, mask=rv)
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(O + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty), mask=rv[:, None] & dm[None, :])


@triton.jit
def _attention_combine_kernel(Part, PartML, O, rows_per_split, Hq, stride_ot, stride_oh, D,
                              NSPLIT: tl.constexpr, BLOCK_D: tl.constexpr):
    _wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, NSPLIT)
    d = tl.arange(0, BLOCK_D)
    idx = sp.to(tl.int64) * rows_per_split + row
    m = tl.load(PartML + idx * 2)
    l = tl.load(PartML + idx * 2 + 1)
    mx = tl.max(m, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(m - mx)
    acc = tl.load(Part + idx[:, None] * BLOCK_D + d[None, :])
    num = tl.sum(tl.where(w[:, None] > 0.0, acc * w[:, None], 0.0), axis=0)
    den = tl.sum(l * w, axis=0)
    den = tl.where(den == 0.0, 1.0, den)
    t = row // Hq
    h = row % Hq
    tl.store(O + t * stride_ot + h * stride_oh + d, (num / den).to(O.dtype.element_ty), mask=d < D)


_PROGRAMS: dict = {}


def _prefill_programs(seq_lens: tuple[int, ...], tpb: int, dev: torch.device) -> torch.Tensor:
    """(sequence, first query token) of every query-block program; cached per batch shape, so that
    a CUDA-graph capture (after its warm-up) makes no host-to-device copy."""
    key = (seq_lens, tpb, str(dev))
    progs = _PROGRAMS.get(key)
    if progs is None:
        prog_seq, prog_qs = [], []
        for i, n in enumerate(seq_lens):
            for qs in range(0, n, tpb):
                prog_seq.append(i)
                prog_qs.append(qs)
        progs = torch.tensor([prog_seq, prog_qs], dtype=torch.int32).to(dev)
        if len(_PROGRAMS) > 512:
            _PROGRAMS.clear()
        _PROGRAMS[key] = progs
    return progs


def paged_attention(q, k_cache, v_cache, seq_lens, context_lens, block_tables, block_size, scaling, cu_seqlens=None, context_lens_t=None):
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    S = len(seq_lens)
    out = torch.empty_like(q)
    if S == 0 or T == 0:
        return out
    dev = q.device
    if cu_seqlens is None:
        cu_seqlens = _cu_seqlens(seq_lens, dev)
    if context_lens_t is None:
        context_lens_t = torch.tensor(context_lens, dtype=torch.int64, device=dev)
    decode = all(n == 1 for n in seq_lens)
    block_d = max(16, _np2(D))
    if decode:
        block_m = max(16, _np2(G))
        tpb = block_m // G
        grid = (S, Hkv)
        pseq = pqs = cu_seqlens  # unused
        block_n = 64
    else:
        block_m = 64 if G <= 64 else _np2(G)
        tpb = block_m // G
        progs = _prefill_programs(tuple(seq_lens), tpb, dev)
        pseq, pqs = progs[0], progs[1]
        grid = (progs.shape[1], Hkv)
        block_n = 64
    # Few programs over long keys: split the keys too. A decode step splits by its batch size alone,
    # whatever the lengths, so that its CUDA graph serves every context length.
    programs = grid[0] * Hkv
    nsplit = 1
    if programs < ATTENTION_TARGET_PROGRAMS and (decode or max(c + n for c, n in zip(context_lens, seq_lens)) >= ATTENTION_SPLIT_MIN_KEYS):
        nsplit = min(64, _np2(ATTENTION_TARGET_PROGRAMS // programs))
    if nsplit > 1:
        # Every split writes the rows of every real token (an empty split: max -inf, sum 0), a decode
        # graph's padding sequences included; a prefill graph's padding tokens (past its device
        # length) are no program's rows, so there they start as empty partial results (weight 0).
        part = torch.empty((nsplit * T * Hq, block_d), dtype=torch.float32, device=dev)
        part_ml = torch.empty((nsplit * T * Hq, 2), dtype=torch.float32, device=dev)
        if not decode:
            part_ml[:, 0] = float("-inf")
            part_ml[:, 1] = 0.0
        _paged_attention_kernel[(grid[0], Hkv, nsplit)](
            q, k_cache, v_cache, out, block_tables, cu_seqlens, context_lens_t, pseq, pqs,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            T * Hq, 0, block_tables.stride(0), block_tables.stride(1), float(scaling), D,
            G=G, TPB=tpb, PAGE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DECODE=decode,
            PREC=_precision(q), NSPLIT=nsplit, Part=part, PartML=part_ml, Hq=Hq, num_warps=4, num_stages=2, **_PDL_LAUNCH,
        )
        _attention_combine_kernel[(T * Hq,)](
            part, part_ml, out, T * Hq, Hq, out.stride(0), out.stride(1), D, NSPLIT=nsplit, BLOCK_D=block_d, num_warps=4, **_PDL_LAUNCH
        )
        return out
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens, context_lens_t, pseq, pqs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), block_tables.stride(1), float(scaling), D,
        G=G, TPB=tpb, PAGE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DECODE=decode,
        PREC=_precision(q), NSPLIT=1, Part=out, PartML=out, Hq=Hq, num_warps=4, num_stages=2, **_PDL_LAUNCH
    )
    return out


# When there are too few (query block, KV head) programs to fill the GPU, decode steps and prefills
# whose keys reach this far (a short turn on top of a long history) split the keys across programs.
ATTENTION_SPLIT_MIN_KEYS = 4096
ATTENTION_TARGET_PROGRAMS = 264


@triton.jit
def _store_kv_kernel(K, V, Kc, Vc, SlotMap, stride_k, stride_v, stride_kc, stride_vc, HD, BLOCK: tl.constexpr):
    _wait_for_previous_kernel()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SlotMap + t).to(tl.int64)
    off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = off < HD
    k = tl.load(K + t * stride_k + off, mask=m, other=0.0)
    v = tl.load(V + t * stride_v + off, mask=m, other=0.0)
    ok = m & (slot >= 0)
    tl.store(Kc + slot * stride_kc + off, k.to(Kc.dtype.element_ty), mask=ok)
    tl.store(Vc + slot * stride_vc + off, v.to(Vc.dtype.element_ty), mask=ok)


def store_kv(k_cache, v_cache, k, v, slot_mapping):
    T = k.shape[0]
    if T == 0:
        return
    k2, v2 = k.reshape(T, -1), v.reshape(T, -1)
    if k2.stride(-1) != 1:
        k2 = k2.contiguous()
    if v2.stride(-1) != 1:
        v2 = v2.contiguous()
    hd = k2.shape[1]
    assert k_cache.stride(1) == k_cache.shape[2] and k_cache.stride(2) == 1
    block = min(1024, _np2(hd))
    _store_kv_kernel[(T, triton.cdiv(hd, block))](
        k2, v2, k_cache, v_cache, slot_mapping, k2.stride(0), v2.stride(0), k_cache.stride(0), v_cache.stride(0), hd, BLOCK=block, num_warps=4, **_PDL_LAUNCH
    )


# ---------------------------------------------------------------------------------------------
# MoE: router top-k, and experts as a grouped GEMM over the routed tokens


@triton.jit
def _topk_softmax_kernel(L, Wt, Ids, stride_l, E, TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    _wait_for_previous_kernel()
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(L + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    # NaN (a CUDA-graph padding row holds whatever was in memory) must still pick distinct valid
    # experts: it counts as -inf, and an expert once taken is not a candidate again even then.
    x = tl.where(x == x, x, float("-inf"))
    free = e < E
    kk = tl.arange(0, BLOCK_K)
    vals = tl.full([BLOCK_K], float("-inf"), dtype=tl.float32)
    idxs = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        m = tl.max(tl.where(free, x, float("-inf")), axis=0)
        i = tl.min(tl.where(free & (x == m), e, BLOCK_E), axis=0)
        vals = tl.where(kk == j, m, vals)
        idxs = tl.where(kk == j, i, idxs)
        free = free & (e != i)
    mx = tl.max(vals, axis=0)
    p = tl.where(kk < TOPK, tl.exp(vals - mx), 0.0)
    p = p / tl.sum(p, axis=0)
    tl.store(Wt + t * TOPK + kk, p, mask=kk < TOPK)
    tl.store(Ids + t * TOPK + kk, idxs.to(tl.int64), mask=kk < TOPK)


def route_softmax_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = router_logits.shape
    assert 0 < top_k <= E, f"top-{top_k} of {E} experts"
    weights = torch.empty((T, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=router_logits.device)
    if T:
        logits = _rows(router_logits)
        _topk_softmax_kernel[(T,)](logits, weights, ids, logits.stride(0), E, TOPK=top_k, BLOCK_E=_np2(E), BLOCK_K=_np2(top_k), num_warps=1, **_PDL_LAUNCH)
    return weights, ids


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:  # silu
        return g * tl.sigmoid(g)
    elif ACT == 1:  # relu^2
        r = tl.maximum(g, 0.0)
        return r * r
    else:  # gelu (erf)
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))


@triton.jit
def _weight_block(W, n, nm, stride_w, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows n, columns k0..k0+BLOCK_K of a weight matrix (zeros outside it)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(W + n[:, None] * stride_w + kk[None, :], mask=nm[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def _dot_rows(x_ptr, w_ptr, n, nm, stride_wn, w_first, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 W[n, :] . x for a block of rows n, given their first BLOCK_K columns `w_first`; the
    K loop is unrolled so that every weight load of the program is in flight at once."""
    acc = tl.zeros(n.shape, dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        w = w_first if k0 == 0 else _weight_block(w_ptr, n, nm, stride_wn, k0, K, BLOCK_K)
        acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
    return acc


@triton.jit
def _expert_up(x_ptr, w_ptr, h_ptr, stride_wn, nb, I, HDIM: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
               WAIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows nb*BLOCK_N.. of one expert's hidden act(W_gate x) * (W_up x), rounded as the reference.
    WAIT: wait for the previous kernel here, once the first weight loads are issued."""
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    dt = h_ptr.dtype.element_ty
    w_gate = _weight_block(w_ptr, n, nm, stride_wn, 0, HDIM, BLOCK_K)
    w_up = _weight_block(w_ptr + I * stride_wn, n, nm, stride_wn, 0, HDIM, BLOCK_K) if GATED else w_gate
    if WAIT:
        _wait_for_previous_kernel()
    g = _dot_rows(x_ptr, w_ptr, n, nm, stride_wn, w_gate, HDIM, BLOCK_K).to(dt).to(tl.float32)
    h = _act(g, ACT).to(dt).to(tl.float32)
    if GATED:
        h = h * _dot_rows(x_ptr, w_ptr + I * stride_wn, n, nm, stride_wn, w_up, HDIM, BLOCK_K).to(dt).to(tl.float32)
    tl.store(h_ptr + n, h.to(dt), mask=nm)


@triton.jit
def _moe_up_gemv_kernel(
    X, Win, Ids, H1, Sin, Hs, stride_x, stride_we, stride_wn, stride_h, stride_sn, stride_hs, TK, I, IS,
    HDIM: tl.constexpr, TOPK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A flat grid: first every routed (token, expert) pair's row blocks, then (with a shared
    expert) every token's row blocks of the shared expert, whose first weights are read before
    the wait (the routed ones need the routing, which the previous kernel writes)."""
    pid = tl.program_id(0).to(tl.int64)
    nbi = tl.cdiv(I, BLOCK_N)
    if pid < TK * nbi:
        _wait_for_previous_kernel()
        a = pid // nbi
        e = tl.load(Ids + a).to(tl.int64)
        _expert_up(X + (a // TOPK) * stride_x, Win + e * stride_we, H1 + a * stride_h, stride_wn, pid % nbi, I,
                   HDIM, GATED, ACT, False, BLOCK_N, BLOCK_K)
    else:
        q = pid - TK * nbi
        nbs = tl.cdiv(IS, BLOCK_N)
        t = q // nbs
        _expert_up(X + t * stride_x, Sin, Hs + t * stride_hs, stride_sn, q % nbs, IS, HDIM, GATED, ACT, True, BLOCK_N, BLOCK_K)


@triton.jit
def _moe_down_gemv_kernel(
    H1, Wout, Ids, Wts, Out, Hs, Sout, stride_h, stride_we, stride_wn, stride_o, stride_hs, stride_sn,
    HDIM: tl.constexpr, I: tl.constexpr, IS: tl.constexpr, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr,
):
    """out[t] = sum over the token's experts of weight * (W_down h) (+ the shared expert's W_down h):
    no atomics. The routing comes from a kernel before the previous one: it and the first weight
    block of every expert of the token are read before the wait."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < HDIM
    j = tl.arange(0, BLOCK_J)
    jm = j < TOPK
    e = tl.load(Ids + t * TOPK + j, mask=jm, other=0)
    wt = tl.load(Wts + t * TOPK + j, mask=jm, other=0.0)
    rows = Wout + e.to(tl.int64)[:, None, None] * stride_we + n[None, :, None] * stride_wn  # [J, N, 1]
    rm = jm[:, None, None] & nm[None, :, None]
    k = tl.arange(0, BLOCK_K)
    w_first = tl.load(rows + k[None, None, :], mask=rm & (k < I)[None, None, :], other=0.0)
    if HAS_SHARED:
        s_first = _weight_block(Sout, n, nm, stride_sn, 0, IS, BLOCK_KS)
    _wait_for_previous_kernel()
    dt = Out.dtype.element_ty
    acc = tl.zeros([BLOCK_J, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, I, BLOCK_K):
        kk = k0 + k
        km = kk < I
        w = w_first if k0 == 0 else tl.load(rows + kk[None, None, :], mask=rm & km[None, None, :], other=0.0)
        h = tl.load(H1 + (t * TOPK + j)[:, None] * stride_h + kk[None, :], mask=jm[:, None] & km[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * h.to(tl.float32)[:, None, :], axis=2)
    o = (acc.to(dt).to(tl.float32) * wt.to(dt).to(tl.float32)[:, None]).to(dt).to(tl.float32)
    out = tl.sum(tl.where(jm[:, None], o, 0.0), axis=0)
    if HAS_SHARED:
        shared = _dot_rows(Hs + t * stride_hs, Sout, n, nm, stride_sn, s_first, IS, BLOCK_KS)
        out = out.to(dt).to(tl.float32) + shared.to(dt).to(tl.float32)
    tl.store(Out + t * stride_o + n, out.to(dt), mask=nm)


@triton.jit
def _grouped_dot(A, W, a_rows, rv, n, nm, stride_a, stride_wn, K, acc,
                 BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """acc + A[a_rows] @ W[n]^T over K: the rows of one block of tokens times one expert's rows n."""
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        a = tl.load(A + a_rows[:, None] * stride_a + kk[None, :], mask=rv[:, None] & km[None, :], other=0.0)
        w = tl.load(W + n[None, :] * stride_wn + kk[:, None], mask=nm[None, :] & km[:, None], other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PREC)
    return acc


@triton.jit
def _grouped_up_tile(X, W, H, x_rows, h_rows, rv, nb, stride_x, stride_wn, stride_h, Hdim, I,
                     GATED: tl.constexpr, ACT: tl.constexpr, WAIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """H[h_rows, block nb] = act(X[x_rows] W_gate^T) * (X[x_rows] W_up^T), rounded as the reference.
    WAIT: wait for the previous kernel before the store (the caller has not waited)."""
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    dt = H.dtype.element_ty
    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g = _grouped_dot(X, W, x_rows, rv, n, nm, stride_x, stride_wn, Hdim, zero, BLOCK_K, PREC)
    h = _act(g.to(dt).to(tl.float32), ACT).to(dt).to(tl.float32)
    if GATED:
        h = h * _grouped_dot(X, W + I * stride_wn, x_rows, rv, n, nm, stride_x, stride_wn, Hdim, zero, BLOCK_K, PREC).to(dt).to(tl.float32)
    if WAIT:
        _wait_for_previous_kernel()
    tl.store(H + h_rows[:, None] * stride_h + n[None, :], h.to(dt), mask=rv[:, None] & nm[None, :])


@triton.jit
def _moe_up_grouped_kernel(
    X, Win, SortedIds, BlockExpert, H1, Sin, Hs, stride_x, stride_we, stride_wn, stride_h, stride_sn, stride_hs,
    Tk, T, Hdim, I, IS, E, NB, SHARED_PROGRAMS,
    TOPK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    """A flat grid: first (with a shared expert, IS > 0) blocks of BLOCK_M tokens through the
    shared expert, whose hidden size may differ; then (block b, column block nb) for every block
    of the routed pairs sorted by expert (b fastest). The shared programs need nothing that the
    previous kernel (the routing's sort, which `moe_experts` launches itself after X is written)
    writes: they compute their tile while it runs and wait only to store it."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < SHARED_PROGRAMS:
        sb = tl.cdiv(T, BLOCK_M)
        t = (pid % sb) * BLOCK_M + tl.arange(0, BLOCK_M)
        _grouped_up_tile(X, Sin, Hs, t, t, t < T, pid // sb, stride_x, stride_sn, stride_hs, Hdim, IS,
                         GATED, ACT, True, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
    else:
        _wait_for_previous_kernel()
        q = pid - SHARED_PROGRAMS
        b = q % NB
        e = tl.load(BlockExpert + b).to(tl.int64)
        if e >= E:
            return
        rows = tl.load(SortedIds + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        _grouped_up_tile(X, Win + e * stride_we, H1, rows // TOPK, rows, rows < Tk, q // NB, stride_x, stride_wn, stride_h, Hdim, I,
                         GATED, ACT, False, BLOCK_M, BLOCK_N, BLOCK_K, PREC)


@triton.jit
def _moe_down_grouped_kernel(
    H1, Wout, SortedIds, BlockExpert, Wts, O2, Hs, Sout, S, stride_h, stride_we, stride_wn, stride_o,
    stride_hs, stride_sn, stride_s, Tk, T, Hdim, I, IS, E, NB,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    """Routed blocks: O2[pair] = weight * (W_down h), each rounded as the reference (so O2 holds them
    exactly in the model's dtype); then (with a shared expert) S[token] = W_shared_down h_shared."""
    _wait_for_previous_kernel()
    b = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < Hdim
    dt = H1.dtype.element_ty
    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if b < NB:
        e = tl.load(BlockExpert + b).to(tl.int64)
        if e >= E:
            return
        rows = tl.load(SortedIds + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rv = rows < Tk
        acc = _grouped_dot(H1, Wout + e * stride_we, rows, rv, n, nm, stride_h, stride_wn, I, zero, BLOCK_K, PREC)
        wt = tl.load(Wts + rows, mask=rv, other=0.0).to(dt).to(tl.float32)
        o = (acc.to(dt).to(tl.float32) * wt[:, None]).to(dt).to(tl.float32)
        tl.store(O2 + rows[:, None] * stride_o + n[None, :], o, mask=rv[:, None] & nm[None, :])
    else:
        t = (b - NB) * BLOCK_M + tl.arange(0, BLOCK_M)
        tv = t < T
        acc = _grouped_dot(Hs, Sout, t, tv, n, nm, stride_hs, stride_sn, IS, zero, BLOCK_K, PREC)
        tl.store(S + t[:, None] * stride_s + n[None, :], acc.to(dt), mask=tv[:, None] & nm[None, :])


def _act_code(act: Callable) -> int | None:
    if act is F.silu:
        return 0
    if act is moe_ref.relu2:
        return 1
    if act is F.gelu:
        return 2
    return None


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed pairs sorted by expert, each expert's run padded to a multiple of block_m.

    Returns (sorted pair indices [max_padded] with Tk as the padding value, expert of each block
    [max_padded // block_m] with num_experts for blocks past the end). Fixed shapes for a given
    number of pairs, no host sync."""
    flat = ids.reshape(-1)
    tk = flat.numel()
    dev = ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    cnt_start = counts.cumsum(0) - counts
    sorted_e, order = torch.sort(flat, stable=True)
    rank = torch.arange(tk, device=dev) - cnt_start[sorted_e]
    dest = pad_start[sorted_e] + rank
    max_padded = tk + min(num_experts, tk) * (block_m - 1)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((max_padded,), tk, dtype=torch.int64, device=dev)
    sorted_ids.index_put_((dest,), order)
    block_start = torch.arange(0, max_padded, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    return sorted_ids, block_expert


@triton.jit
def _align_pairs(ids, a, invalid, SortedIds, BlockExpert, Tk, NB, MAXP, E,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """This program's part of `moe_align` (program e < E: expert e's run; program E: the tail) from
    the experts `ids` of the pairs `a` in increasing order (a 1-D block; `invalid` of its entries
    are no pairs and hold expert 0): every program counts all pairs per expert (a histogram),
    takes its padded offset, and scatters its pairs there in order (ranks by a cumulative sum),
    then pads its run and marks its blocks. The last program pads the space past the last run."""
    e = tl.program_id(0)
    eo = tl.arange(0, BLOCK_E)
    counts = tl.histogram(ids, BLOCK_E) - tl.where(eo == 0, invalid, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if e < E:
        start = tl.sum(tl.where(eo < e, padded, 0), axis=0)
        count = tl.sum(tl.where(eo == e, counts, 0), axis=0)
        mine = ((ids == e) & (a < Tk)).to(tl.int32)
        rank = tl.cumsum(mine, axis=0) - mine
        tl.store(SortedIds + start + rank, a.to(tl.int64), mask=mine > 0)
        pad = count + tl.arange(0, BLOCK_M)
        end = start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(SortedIds + start + pad, tl.zeros([BLOCK_M], dtype=tl.int64) + Tk, mask=start + pad < end)
        for b0 in range(start // BLOCK_M, end // BLOCK_M, CHUNK):
            b = b0 + tl.arange(0, CHUNK)
            tl.store(BlockExpert + b, tl.zeros([CHUNK], dtype=tl.int64) + e, mask=b < end // BLOCK_M)
    else:
        total = tl.sum(padded, axis=0)
        for p0 in range(total, MAXP, CHUNK):
            p = p0 + tl.arange(0, CHUNK)
            tl.store(SortedIds + p, tl.zeros([CHUNK], dtype=tl.int64) + Tk, mask=p < MAXP)
        for b0 in range(total // BLOCK_M, NB, CHUNK):
            b = b0 + tl.arange(0, CHUNK)
            tl.store(BlockExpert + b, tl.zeros([CHUNK], dtype=tl.int64) + E, mask=b < NB)


@triton.jit
def _moe_align_kernel(Ids, SortedIds, BlockExpert, Tk, NB, MAXP, E,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr):
    """`moe_align`, one program per expert and one more for the tail (`_align_pairs`)."""
    _wait_for_previous_kernel()
    a = tl.arange(0, BLOCK_T)
    ids = tl.load(Ids + a, mask=a < Tk, other=0).to(tl.int32)
    _align_pairs(ids, a, BLOCK_T - Tk, SortedIds, BlockExpert, Tk, NB, MAXP, E, BLOCK_M, BLOCK_E, CHUNK)


@triton.jit
def _topk_align_kernel(L, Wt, Ids, SortedIds, BlockExpert, stride_l, T, NB, MAXP, E,
                       TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """`route_softmax_topk` of all T rows and `moe_align` of their pairs in one launch: each of the
    E + 1 programs takes the top-k of every row (as `_topk_softmax_kernel`, a row per tile row),
    program 0 stores the weights and ids, and each then does its part of the sort (`_align_pairs`)."""
    _wait_for_previous_kernel()
    t = tl.arange(0, BLOCK_T)
    tm = t < T
    e = tl.arange(0, BLOCK_E)
    x = tl.load(L + t[:, None] * stride_l + e[None, :], mask=tm[:, None] & (e < E)[None, :], other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))
    free = tm[:, None] & (e < E)[None, :]
    kk = tl.arange(0, BLOCK_K)
    vals = tl.full([BLOCK_T, BLOCK_K], float("-inf"), dtype=tl.float32)
    idxs = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        m = tl.max(tl.where(free, x, float("-inf")), axis=1)
        i = tl.min(tl.where(free & (x == m[:, None]), e[None, :], BLOCK_E), axis=1)
        vals = tl.where(kk[None, :] == j, m[:, None], vals)
        idxs = tl.where(kk[None, :] == j, i[:, None], idxs)
        free = free & (e[None, :] != i[:, None])
    mx = tl.max(vals, axis=1)
    p = tl.where(kk[None, :] < TOPK, tl.exp(vals - mx[:, None]), 0.0)
    p = p / tl.sum(p, axis=1)[:, None]
    pair = t[:, None] * TOPK + kk[None, :]
    valid = tm[:, None] & (kk[None, :] < TOPK)
    if tl.program_id(0) == 0:
        tl.store(Wt + pair, p, mask=valid)
        tl.store(Ids + pair, idxs.to(tl.int64), mask=valid)
    ids = tl.reshape(tl.where(valid, idxs, 0), [BLOCK_T * BLOCK_K])
    a = tl.reshape(tl.where(valid, pair, T * TOPK), [BLOCK_T * BLOCK_K])  # invalid entries: past every pair
    _align_pairs(ids, a, BLOCK_T * BLOCK_K - T * TOPK, SortedIds, BlockExpert, T * TOPK, NB, MAXP, E, BLOCK_M, BLOCK_E, CHUNK)


MOE_ALIGN_KERNEL_MAX_PAIRS = 4096


def _sorted_pairs(tk: int, num_experts: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align`'s outputs, uninitialized: sorted pair ids [max_padded], block experts [blocks]."""
    max_padded = tk + min(num_experts, tk) * (block_m - 1)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    sorted_ids = torch.empty(max_padded, dtype=torch.int64, device=device)
    return sorted_ids, torch.empty(max_padded // block_m, dtype=torch.int64, device=device)


def moe_align_triton(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align` as one launch (small batches: decode steps, short prefill chunks)."""
    flat = ids.reshape(-1).contiguous()
    tk = flat.numel()
    sorted_ids, block_expert = _sorted_pairs(tk, num_experts, block_m, ids.device)
    _moe_align_kernel[(num_experts + 1,)](flat, sorted_ids, block_expert, tk, block_expert.numel(), sorted_ids.numel(), num_experts,
                                          BLOCK_M=block_m, BLOCK_E=_np2(num_experts), BLOCK_T=_np2(tk), CHUNK=128,
                                          num_warps=4, **_PDL_LAUNCH)
    return sorted_ids, block_expert


# Router logits per launch up to which `softmax_topk_experts` takes the top-k and sorts the pairs in
# one launch (each program holds all of them). On the H200 with 64 experts, one launch saved 4% of a
# step at 8 tokens and cost 0.4-3% at 16-64 (BENCHMARKS.md), where each program's top-k of all rows
# outweighs the launch it saves.
TOPK_ALIGN_MAX_LOGITS = 512


def route_softmax_topk_align(router_logits: torch.Tensor, top_k: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """`route_softmax_topk` and `moe_align` of its pairs in one launch: (weights, ids, sorted ids, block experts)."""
    T, E = router_logits.shape
    assert 0 < top_k <= E, f"top-{top_k} of {E} experts"
    logits = _rows(router_logits)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    sorted_ids, block_expert = _sorted_pairs(T * top_k, E, block_m, logits.device)
    _topk_align_kernel[(E + 1,)](
        logits, weights, ids, sorted_ids, block_expert, logits.stride(0), T, block_expert.numel(), sorted_ids.numel(), E,
        TOPK=top_k, BLOCK_T=_np2(T), BLOCK_E=_np2(E), BLOCK_K=_np2(top_k), BLOCK_M=block_m, CHUNK=128, num_warps=4, **_PDL_LAUNCH,
    )
    return weights, ids, sorted_ids, block_expert


# Up to this many routed (token, expert) pairs, each pair is its own GEMV (decode at small batch:
# fewer launches, each expert's weights read once per pair); above it, the grouped GEMM.
MOE_GEMV_MAX_PAIRS = 32


@triton.jit
def _moe_combine_kernel(O2, S, Out, stride_o, stride_s, stride_out, HDIM, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK: tl.constexpr):
    """out[t] = sum of the token's TOPK weighted expert rows (in float32), rounded, + its shared row."""
    _wait_for_previous_kernel()
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nm = n < HDIM
    dt = Out.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(O2 + (t * TOPK + j) * stride_o + n, mask=nm, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc = acc.to(dt).to(tl.float32) + tl.load(S + t * stride_s + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_out + n, acc.to(dt), mask=nm)


def moe_experts(x, w_in, w_out, weights, ids, act, gated, shared=None):
    return _moe(x, w_in, w_out, act, gated, shared, ids.shape[1], lambda: (weights, ids))


def softmax_topk_experts(x, router_logits, top_k, w_in, w_out, act, gated, shared=None):
    """As the reference; a batch of grouped-GEMM size takes the top-k and sorts the routed pairs in
    one launch (`route_softmax_topk_align`)."""
    return _moe(x, w_in, w_out, act, gated, shared, top_k, lambda: route_softmax_topk(router_logits, top_k), router_logits)


def _moe(x, w_in, w_out, act, gated, shared, top_k, route: Callable, router_logits=None):
    """`moe_experts` for the routing `route()` = (weights, ids); with `router_logits` (softmax top-k
    routing) the grouped path may route and sort in one launch instead."""
    code = _act_code(act)
    if code is None:
        return moe_ref.moe_experts(x, w_in, w_out, *route(), act, gated, shared)
    T, Hdim = x.shape
    E, I = w_out.shape[0], w_out.shape[2]
    tk = T * top_k
    out = torch.empty((T, Hdim), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x = _rows(x)
    assert w_in.stride(-1) == 1 and w_out.stride(-1) == 1
    h1 = torch.empty((tk, I), dtype=x.dtype, device=x.device)
    if tk <= MOE_GEMV_MAX_PAIRS and Hdim <= 8192 and I <= 8192:
        weights, ids = route()
        return _moe_gemv(x, w_in, w_out, weights.contiguous(), ids.contiguous(), code, gated, shared, h1, out)
    small = tk <= MOE_GROUPED_SMALL_PAIRS
    bm, bn, bk, warps, stages = GEMV_CONFIG["moe_grouped_up"] if small else (64, 128, 64, 8, 3)
    dbn, dbk, dwarps, dstages = GEMV_CONFIG["moe_grouped_down"] if small else (128, 64, 8, 3)
    if router_logits is not None and _np2(T) * _np2(E) <= TOPK_ALIGN_MAX_LOGITS and E <= 512:
        weights, ids, sorted_ids, block_expert = route_softmax_topk_align(router_logits, top_k, bm)
    else:
        weights, ids = route()
        weights, ids = weights.contiguous(), ids.contiguous()
        if tk <= MOE_ALIGN_KERNEL_MAX_PAIRS and E <= 512:
            sorted_ids, block_expert = moe_align_triton(ids, E, bm)
        else:
            sorted_ids, block_expert = moe_align(ids, E, bm)
    nblocks = block_expert.numel()
    prec = _precision(x)
    # Small batches run the shared expert as extra programs of the two grouped launches; large
    # ones (prefill) through cuBLAS, which is faster there than this GEMM.
    fuse_shared = shared is not None and small
    s_in, s_out = shared if fuse_shared else (w_in[0], w_out[0])  # unused stand-ins when not fused
    i_s = s_out.shape[1] if fuse_shared else 0
    hs = torch.empty((T, max(i_s, 1)), dtype=x.dtype, device=x.device)
    s = torch.empty((T, Hdim), dtype=x.dtype, device=x.device) if fuse_shared else None
    shared_blocks = triton.cdiv(T, bm) if fuse_shared else 0
    shared_programs = shared_blocks * triton.cdiv(i_s, bn)
    _moe_up_grouped_kernel[(shared_programs + nblocks * triton.cdiv(I, bn),)](
        x, w_in, sorted_ids, block_expert, h1, s_in, hs, x.stride(0), w_in.stride(0), w_in.stride(1), h1.stride(0),
        s_in.stride(0), hs.stride(0), tk, T, Hdim, I, i_s, E, nblocks, shared_programs,
        TOPK=top_k, GATED=gated, ACT=code, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PREC=prec, num_warps=warps, num_stages=stages, **_PDL_LAUNCH
    )
    o2 = torch.empty((tk, Hdim), dtype=x.dtype, device=x.device)
    _moe_down_grouped_kernel[(nblocks + shared_blocks, triton.cdiv(Hdim, dbn))](
        h1, w_out, sorted_ids, block_expert, weights.reshape(-1), o2, hs, s_out, s if fuse_shared else o2,
        h1.stride(0), w_out.stride(0), w_out.stride(1), o2.stride(0), hs.stride(0), s_out.stride(0), Hdim,  # S is contiguous [T, Hdim]
        tk, T, Hdim, I, max(i_s, 1), E, nblocks,
        BLOCK_M=bm, BLOCK_N=dbn, BLOCK_K=dbk, PREC=prec, num_warps=dwarps, num_stages=dstages, **_PDL_LAUNCH
    )
    if shared is not None and not fuse_shared:
        s = _shared_expert(x, shared, act, gated)
    s_arg = s if s is not None else o2
    block = min(256, _np2(Hdim))
    _moe_combine_kernel[(T, triton.cdiv(Hdim, block))](
        o2, s_arg, out, o2.stride(0), s_arg.stride(0), out.stride(0), Hdim, TOPK=top_k, HAS_SHARED=shared is not None,
        BLOCK=block, num_warps=2, **_PDL_LAUNCH
    )
    return out


def _shared_expert(x, shared, act, gated):
    if gated and act is F.silu:
        return F.linear(silu_and_mul(F.linear(x, shared[0])), shared[1])
    return moe_ref.expert_mlp(x, *shared, act, gated)


def _moe_gemv(x, w_in, w_out, weights, ids, code, gated, shared, h1, out):
    """Small batches: one program per (pair or token, row block); the shared expert, if any, runs
    in the same two launches as the routed ones."""
    T, Hdim = x.shape
    I = w_out.shape[2]
    top_k = ids.shape[1]
    tk = T * top_k
    s_in, s_out = shared if shared is not None else (w_in[0], w_out[0])
    assert s_in.stride(-1) == 1 and s_out.stride(-1) == 1
    i_s = s_out.shape[1] if shared is not None else 0
    hs = torch.empty((T, max(i_s, 1)), dtype=x.dtype, device=x.device)
    bn, bk, warps = GEMV_CONFIG["moe_up"]
    programs = tk * triton.cdiv(I, bn) + T * triton.cdiv(i_s, bn)
    _moe_up_gemv_kernel[(programs,)](
        x, w_in, ids, h1, s_in, hs, x.stride(0), w_in.stride(0), w_in.stride(1), h1.stride(0), s_in.stride(0), hs.stride(0),
        tk, I, i_s, HDIM=Hdim, TOPK=top_k, GATED=gated, ACT=code, BLOCK_N=bn, BLOCK_K=min(bk, _np2(Hdim)), num_warps=warps, **_PDL_LAUNCH
    )
    bn, bk, warps = GEMV_CONFIG["moe_down"]
    _moe_down_gemv_kernel[(T, triton.cdiv(Hdim, bn))](
        h1, w_out, ids, weights, out, hs, s_out, h1.stride(0), w_out.stride(0), w_out.stride(1), out.stride(0), hs.stride(0),
        s_out.stride(0), HDIM=Hdim, I=I, IS=max(i_s, 1), TOPK=top_k, HAS_SHARED=shared is not None, BLOCK_J=_np2(top_k),
        BLOCK_N=bn, BLOCK_K=min(bk, _np2(I)), BLOCK_KS=min(bk, _np2(i_s)), num_warps=warps, **_PDL_LAUNCH
    )
    return out


# ---------------------------------------------------------------------------------------------
# Sampling: the greedy token (torch's argmax of one long row runs in one thread block)


@triton.jit
def _first_max(x, i):
    """(largest value, its first index i) of a vector, with torch.argmax's order: any NaN is larger
    than every number (the value is then NaN, the index the first NaN's)."""
    nan = x != x
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    x = tl.where(nan, float("-inf"), x)
    m = tl.max(x, axis=0)
    first = tl.min(tl.where(tl.where(has_nan, nan, x == m), i, 2**31 - 1), axis=0)
    return tl.where(has_nan, float("nan"), m), first


@triton.jit
def _argmax_chunk_kernel(L, Val, Idx, stride_l, V, NC, BLOCK: tl.constexpr):
    """Largest value of row r's chunk c and its first index."""
    _wait_for_previous_kernel()
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    i = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(L + r * stride_l + i, mask=i < V, other=float("-inf")).to(tl.float32)
    m, first = _first_max(x, i)
    tl.store(Val + r * NC + c, m)
    tl.store(Idx + r * NC + c, first)


@triton.jit
def _argmax_rows_kernel(Val, Idx, Out, NC, BLOCK_C: tl.constexpr):
    """Row r's argmax from its chunks' (value, first index): the first chunk with the largest value."""
    _wait_for_previous_kernel()
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    v = tl.load(Val + r * NC + c, mask=c < NC, other=float("-inf"))
    i = tl.load(Idx + r * NC + c, mask=c < NC, other=2**31 - 1)
    chunk = _first_max(v, c)[1]
    tl.store(Out + r, tl.sum(tl.where(c == chunk, i, 0), axis=0).to(tl.int64))


ARGMAX_CHUNK = 4096


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [R, V] of float32 or half logits into a contiguous int64 `out` of R (or a new one);
    anything else goes to the reference."""
    shaped = logits.dim() == 2 and logits.shape[1] > 0 and logits.dtype in _TL_DTYPES
    if not shaped or (out is not None and (out.dtype != torch.int64 or out.shape != logits.shape[:1] or not out.is_contiguous())):
        return sample_ref.argmax(logits, out=out)
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int64, device=logits.device) if out is None else out
    if R == 0:
        return out
    x = _rows(logits)
    nc = triton.cdiv(V, ARGMAX_CHUNK)
    val = torch.empty((R, nc), dtype=torch.float32, device=x.device)
    idx = torch.empty((R, nc), dtype=torch.int32, device=x.device)
    _argmax_chunk_kernel[(R, nc)](x, val, idx, x.stride(0), V, nc, BLOCK=ARGMAX_CHUNK, num_warps=8, **_PDL_LAUNCH)
    _argmax_rows_kernel[(R,)](val, idx, out, nc, BLOCK_C=_np2(nc), num_warps=1, **_PDL_LAUNCH)
    return out


# ---------------------------------------------------------------------------------------------
# Linear layers at small batch (decode): a GEMV that reads each weight row once for all rows of x


@triton.jit
def _row_rsqrt(Part, m, mm, stride_part, NPART, GS, eps, BLOCK_PART: tl.constexpr):
    """1 / sqrt(mean square + eps) of rows m, from the sums of squares of their parts (Part[m, :NPART],
    stored by the GATED SSD update), over GS values."""
    j = tl.arange(0, BLOCK_PART)
    part = tl.load(Part + m[:, None] * stride_part + j[None, :], mask=mm[:, None] & (j < NPART)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(part, axis=1) / GS + eps)


@triton.jit
def _gemv_kernel(
    X, W, B, Y, M, N, stride_x, stride_w, stride_y,
    CW, CB, Pool, Slots, conv_start, C, stride_wc, stride_wk, stride_ps, stride_pk,
    Part, stride_part, NPART, GS, eps,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, CONV: tl.constexpr, CONV_K: tl.constexpr, CONV_BIAS: tl.constexpr,
    ROW_RSQRT: tl.constexpr, BLOCK_PART: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
    w_first = _weight_block(W, n, nm, stride_w, 0, K, BLOCK_K)
    _wait_for_previous_kernel()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        w = (w_first if k0 == 0 else _weight_block(W, n, nm, stride_w, k0, K, BLOCK_K)).to(tl.float32)
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
        y = _conv_step(out, Pool + slot[:, None] * stride_ps + c[None, :], stride_pk, CW + c[None, :] * stride_wc, stride_wk, bias,
                       cm, cm & (slot >= 0)[:, None], CONV_K)
        out = tl.where(in_conv[None, :], y.to(out.dtype), out)
    tl.store(Y + m[:, None] * stride_y + n[None, :], out, mask=mm[:, None] & nm[None, :])


@triton.jit
def _linear_dot_kernel(
    X, W, B, Y, M, N, stride_x, stride_w, stride_y,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
):
    """y = x W^T (+ b) for up to BLOCK_M rows on tensor cores (decode batches of a few dozen): one
    program per BLOCK_N output columns, all rows at once, so each weight is read once."""
    _wait_for_previous_kernel()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, BLOCK_M)
    mm = m < M
    acc = _grouped_dot(X, W, m, mm, n, nm, stride_x, stride_w, K, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), BLOCK_K, PREC)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_y + n[None, :], acc.to(Y.dtype.element_ty), mask=mm[:, None] & nm[None, :])


# Rows of x up to which `linear` runs the GEMV above, and then the tensor-core kernel, instead of cuBLAS.
LINEAR_GEMV_MAX_ROWS = 4
LINEAR_DOT_MAX_ROWS = 64

# Block sizes of the small-batch kernels, measured on an H200 with benchmarks/tune_gemv.py and
# benchmarks/tune_in_model.py (the MoE GEMVs and the single-row GEMVs, inside the decode step at batch 1):
# (BLOCK_N, BLOCK_K, num_warps) of the GEMVs; (BLOCK_N, BLOCK_K, num_warps, num_stages) of the
# linear layers' tensor-core kernel, for layers wide enough to give every SM a program at that
# BLOCK_N and for narrower ones; up to MOE_GROUPED_SMALL_PAIRS routed pairs, the grouped MoE GEMM's
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for the up projection and (BLOCK_N, BLOCK_K,
# num_warps, num_stages) for the down projection (`--rows 64`).
GEMV_CONFIG = {
    "linear": (2, 1024, 1), "linear_row": (4, 1024, 1), "linear_row_long_k": (2, 4096, 1),
    "linear_dot": (32, 128, 4, 4), "linear_dot_narrow": (16, 256, 4, 4),
    "moe_up": (2, 2048, 2), "moe_down": (2, 512, 1), "moe_grouped_up": (16, 32, 64, 4, 3), "moe_grouped_down": (64, 128, 4, 3),
}
MOE_GROUPED_SMALL_PAIRS = 2048
# A single row (decode at batch 1) longer than this takes the GEMV's "linear_row_long_k" blocks
# (Mamba2's out_proj), a shorter one "linear_row"; 2-4 rows take "linear".
LINEAR_GEMV_LONG_K = 2048


def _small_linear_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return weight.stride(-1) == 1 and x.dtype == weight.dtype and (bias is None or bias.stride(-1) == 1)


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
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
    return args, dict(ROW_RSQRT=row_rsqrt is not None, BLOCK_PART=_np2(part.shape[-1]) if row_rsqrt is not None else 1)


def _gemv_config(rows: int, k: int) -> tuple[int, int, int]:
    if rows == 1:
        return GEMV_CONFIG["linear_row_long_k" if k > LINEAR_GEMV_LONG_K else "linear_row"]
    return GEMV_CONFIG["linear"]


def _gemv(x, weight, bias, conv=None, row_rsqrt=None):
    K = x.shape[-1]
    x2 = _rows(x)
    M, N = x2.shape[0], weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    cw, cb, pool, slots, conv_start = conv if conv is not None else (weight, None, weight, weight, 0)
    rsqrt_args, rsqrt_flags = _row_rsqrt_args(row_rsqrt, weight)
    bn, bk, warps = _gemv_config(M, K)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x2, weight, bias if bias is not None else weight, y, M, N, x2.stride(0), weight.stride(0), y.stride(0),
        cw, cb if cb is not None else cw, pool, slots, conv_start, cw.shape[0], cw.stride(0), cw.stride(-1), pool.stride(0),
        pool.stride(1), *rsqrt_args, K=K, HAS_BIAS=bias is not None, CONV=conv is not None,
        CONV_K=cw.shape[-1] if conv is not None else 0, CONV_BIAS=cb is not None, **rsqrt_flags,
        BLOCK_M=_np2(M), BLOCK_N=bn, BLOCK_K=min(bk, _np2(K)), num_warps=warps, **_PDL_LAUNCH,
    )
    return y.view(*x.shape[:-1], N)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


# A layer with at least this many output columns per SM takes the tensor-core kernel's "linear_dot"
# blocks, a narrower one "linear_dot_narrow".
LINEAR_DOT_WIDE_COLUMNS_PER_SM = 32


def linear_dot_config_key(n: int, device: torch.device) -> str:
    """Which GEMV_CONFIG entry the tensor-core kernel takes for a layer of n output columns."""
    return "linear_dot" if n >= LINEAR_DOT_WIDE_COLUMNS_PER_SM * _sm_count(device) else "linear_dot_narrow"


def _linear_dot(x, weight, bias):
    K = x.shape[-1]
    x2 = _rows(x)
    M, N = x2.shape[0], weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = GEMV_CONFIG[linear_dot_config_key(N, x.device)]
    bk = bk * 2 // x.element_size()  # the blocks are tuned for 2-byte types: the same shared memory for float32
    _linear_dot_kernel[(triton.cdiv(N, bn),)](
        x2, weight, bias if bias is not None else weight, y, M, N, x2.stride(0), weight.stride(0), y.stride(0),
        K=K, HAS_BIAS=bias is not None, BLOCK_M=max(16, _np2(M)), BLOCK_N=bn, BLOCK_K=min(bk, _np2(K)), PREC=_precision(x),
        num_warps=warps, num_stages=stages, **_PDL_LAUNCH,
    )
    return y.view(*x.shape[:-1], N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _gemv_applies(x, weight, bias):
        return _gemv(x, weight, bias)
    if _linear_dot_applies(x, weight, bias):
        return _linear_dot(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_conv_update(x, weight, bias, conv_weight, conv_bias, conv_pool, slots, conv_start):
    """Up to LINEAR_GEMV_MAX_ROWS rows the conv update rides in the GEMV's epilogue; above, it is
    its own kernel after the projection (in the tensor-core kernel's accumulator layout its pool
    reads and writes would be scattered)."""
    if _gemv_applies(x, weight, bias):
        assert 2 <= conv_weight.shape[1] <= 4, "the fused conv update handles kernel widths 2..4"
        return _gemv(x, weight, bias, (conv_weight, conv_bias, conv_pool, slots, conv_start))
    proj = linear(x, weight, bias)
    xbc = proj[:, conv_start : conv_start + conv_weight.shape[0]]
    _launch_conv_update(xbc, conv_weight, conv_bias, conv_pool, slots, xbc)  # in place: each element read, then written
    return proj
