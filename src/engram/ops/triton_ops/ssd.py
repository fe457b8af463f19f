"""Mamba2's SSD: the single-token state update (state in the pool [slots, H, P, N]), with the gated
norm folded into the output projection at small batch, the token-by-token varlen scan, and a
speculative verify step's scan that keeps every position's state."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engram.ops.triton_ops.common import PDL_LAUNCH, cu_seqlens_of, keep_verified, np2, verify_args, verify_row, wait_for_previous_kernel
from engram.ops.triton_ops.linear import gemv, gemv_applies, linear
from engram.ops.triton_ops.norm import gated_rms_norm


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
    return h, h // HPG, p, n, pm, nm, ptr, tl.where(slot >= 0, pm[:, None] & nm[None, :], False)


@triton.jit
def _ssd_dt(dt, dt_bias, dt_min, dt_max):
    """softplus(dt + dt_bias) (threshold 20, as torch), clamped to the time-step limit."""
    dt = dt + dt_bias
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
    return tl.minimum(tl.maximum(dt, dt_min), dt_max)


@triton.jit
def _ssd_update_kernel(
    Pool,
    Slots,
    X,
    DT,
    DtBias,
    ALog,
    Bm,
    Cm,
    Dp,
    Y,
    stride_ps,
    stride_ph,
    stride_pp,
    stride_xs,
    stride_xh,
    stride_dts,
    stride_bs,
    stride_bg,
    stride_cs,
    stride_cg,
    stride_ys,
    stride_yh,
    P,
    N,
    HPG,
    dt_min,
    dt_max,
    Z,
    NormW,
    Part,
    stride_zs,
    stride_part,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GATED: tl.constexpr,
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
    wait_for_previous_kernel()
    dt = _ssd_dt(tl.load(DT + s * stride_dts + h).to(tl.float32), dt_bias, dt_min, dt_max)
    x = tl.load(X + s * stride_xs + h * stride_xh + p, mask=pm, other=0.0).to(tl.float32)
    b = tl.load(Bm + s * stride_bs + g * stride_bg + n, mask=nm, other=0.0).to(tl.float32)
    c = tl.load(Cm + s * stride_cs + g * stride_cg + n, mask=nm, other=0.0).to(tl.float32)
    st = st * tl.exp(dt * A) + (x * dt)[:, None] * b[None, :]
    # The new state is stored with L2's evict_last priority (kept while other lines are evicted):
    # the batch-64 step on the H200 took 1.1% less, its SSD updates and MoE up projections less
    # time (BENCHMARKS.md, seventh session of 2026-11-30; the cause was not traced).
    tl.store(ptr, st.to(Pool.dtype.element_ty), mask=m2, eviction_policy="evict_last")
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
        ssm_pool.stride(0),
        ssm_pool.stride(1),
        ssm_pool.stride(2),
        x.stride(0),
        x.stride(1),
        dt.stride(0),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        y.stride(0),
        y.stride(1),
        x.shape[2],
        B.shape[2],
        x.shape[1] // B.shape[1],
        float(dt_limit[0]),
        float(dt_limit[1]),
    )


def _ssd_update_block_p(head_dim: int) -> int:
    """BLOCK_P of the SSD update: programs of 8 rows of a head's state (`h200-ssd-update-blocks.log`)."""
    return min(8, np2(head_dim))


def _launch_ssd_update(ssm_pool, slots, x, dt, dt_bias, dt_limit, A_log, B, C, D, y, gated=None):
    """`gated`: (gate, norm_weight, part) for the GATED variant of the kernel, y then [S, H * P]."""
    S, H, P = x.shape
    bp = _ssd_update_block_p(P)
    z, norm_weight, part = gated if gated is not None else (y, y, y)
    _ssd_update_kernel[(S, H, triton.cdiv(P, bp))](
        ssm_pool,
        slots,
        x,
        dt,
        dt_bias,
        A_log,
        B,
        C,
        D,
        y,
        *_ssd_strides(ssm_pool, x, dt, B, C, y.view(S, H, P), dt_limit),
        z,
        norm_weight,
        part,
        z.stride(0),
        part.stride(0),
        BLOCK_P=bp,
        BLOCK_N=np2(B.shape[2]),
        GATED=gated is not None,
        num_warps=2,
        **PDL_LAUNCH,
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


def ssd_state_update_norm_linear(ssm_pool, slots, x, dt, dt_bias, dt_limit, A_log, B, C, D, gate, norm_weight, eps, group_size, weight, bias=None):
    """With one norm group over the whole row and the GEMV's batch sizes, the gated norm has no launch
    of its own: the SSD update stores norm_weight * y * silu(gate) and per-program sums of squares,
    and the output projection's GEMV scales each row's dot products by the rsqrt of the row's mean
    square. The rounding differs from the reference's (normalize, round, scale by the weight, round,
    project) in the order of one rounding. Otherwise, the three kernels one after another (the same
    scaling in the tensor-core kernel was slower at batches 8 and 64: BENCHMARKS.md)."""
    S, H, P = x.shape
    parts = H * triton.cdiv(P, _ssd_update_block_p(P))
    # the gate has the shape of the projection's input, and its dtype when the GEMV applies
    fused = gemv_applies(gate, weight, bias) and group_size == H * P and parts <= SSD_NORM_MAX_PARTS
    if not (fused and weight.dtype in (torch.bfloat16, torch.float32) and gate.stride(-1) == 1):
        y = ssd_state_update(ssm_pool, slots, x, dt, dt_bias, dt_limit, A_log, B, C, D)
        return linear(gated_rms_norm(y.view(S, H * P), gate, norm_weight, eps, group_size, weight.dtype), weight, bias)
    assert x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1 and ssm_pool.stride(3) == 1
    u = torch.empty((S, H * P), dtype=weight.dtype, device=x.device)
    part = torch.empty((S, parts), dtype=torch.float32, device=x.device)
    _launch_ssd_update(ssm_pool, slots, x, dt, dt_bias, dt_limit, A_log, B, C, D, u, (gate, norm_weight, part))
    return gemv(u, weight, bias, row_rsqrt=(part, float(group_size), float(eps)))


@triton.jit
def _ssd_scan_kernel(
    Pool,
    Slots,
    Cu,
    X,
    DT,
    DtBias,
    ALog,
    Bm,
    Cm,
    Dp,
    Y,
    stride_ps,
    stride_ph,
    stride_pp,
    stride_xt,
    stride_xh,
    stride_dtt,
    stride_bt,
    stride_bg,
    stride_ct,
    stride_cg,
    stride_yt,
    stride_yh,
    P,
    N,
    HPG,
    dt_min,
    dt_max,
    Rows,
    States,
    stride_rs,
    stride_ss,
    stride_sl,
    stride_sh,
    stride_sp,
    L,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VERIFY: tl.constexpr,
):
    """The SSD recurrence token by token over each sequence of a flat batch, state in registers
    (read from and written back to the pool by slot). For short prefill chunks: one launch, exact.

    VERIFY (a speculative verify step, ops/verify.py:ssd_verify): the sequence's L positions are the
    flat rows Rows[s, :] (past its length its last row again, whose y is not stored twice), the
    state after each is stored in States[s, t] (rounded to its dtype, and carried on rounded, as
    decode steps do), and the pool is not written."""
    wait_for_previous_kernel()
    s = tl.program_id(0).to(tl.int64)
    h, g, p, n, pm, nm, ptr, m2 = _ssd_tile(Pool, Slots, s, stride_ps, stride_ph, stride_pp, P, N, HPG, BLOCK_P, BLOCK_N)
    if VERIFY:
        start = 0
        end = L
    else:
        start = tl.load(Cu + s)
        end = tl.load(Cu + s + 1)
    st = tl.load(ptr, mask=m2, other=0.0).to(tl.float32)
    dtb = tl.load(DtBias + h).to(tl.float32)
    A = -tl.exp(tl.load(ALog + h).to(tl.float32))
    Dh = tl.load(Dp + h).to(tl.float32)
    out = States + s * stride_ss + h * stride_sh + p[:, None] * stride_sp + n[None, :]
    last = s * 0 - 1  # VERIFY: the flat row whose y was stored last (int64)
    for i in range(start, end):
        t = verify_row(Rows, stride_rs, s, i, VERIFY)
        dt = _ssd_dt(tl.load(DT + t * stride_dtt + h).to(tl.float32), dtb, dt_min, dt_max)
        x = tl.load(X + t * stride_xt + h * stride_xh + p, mask=pm, other=0.0).to(tl.float32)
        b = tl.load(Bm + t * stride_bt + g * stride_bg + n, mask=nm, other=0.0).to(tl.float32)
        c = tl.load(Cm + t * stride_ct + g * stride_cg + n, mask=nm, other=0.0).to(tl.float32)
        st = st * tl.exp(dt * A) + (x * dt)[:, None] * b[None, :]
        y = tl.sum(st * c[None, :], axis=1) + x * Dh
        if VERIFY:
            st = keep_verified(Y + t * stride_yt + h * stride_yh + p, y, pm, t, last, out + i * stride_sl, st, pm[:, None] & nm[None, :])
            last = t
        else:
            tl.store(Y + t * stride_yt + h * stride_yh + p, y, mask=pm)
    if not VERIFY:
        tl.store(ptr, st.to(Pool.dtype.element_ty), mask=m2)


def _launch_scan(x, dt, dt_bias, dt_limit, A_log, B, C, D, ssm_pool, slots, y, cu_seqlens, S, verify=None):
    """The scan kernel over S sequences; `verify`: (rows, states) for its VERIFY variant."""
    H, P = x.shape[1], x.shape[2]
    assert x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1 and ssm_pool.stride(3) == 1
    bp = min(16, np2(P))
    _ssd_scan_kernel[(S, H, triton.cdiv(P, bp))](
        ssm_pool,
        slots,
        cu_seqlens,
        x,
        dt,
        dt_bias,
        A_log,
        B,
        C,
        D,
        y,
        *_ssd_strides(ssm_pool, x, dt, B, C, y, dt_limit),
        *verify_args(verify, slots, y),
        BLOCK_P=bp,
        BLOCK_N=np2(B.shape[2]),
        VERIFY=verify is not None,
        num_warps=4,
        **PDL_LAUNCH,
    )


# Sequences up to this long take the token-by-token scan (one launch, little host work); longer
# prefills take the chunked kernels (fla-core). On the H200 (Granite-4.0-H-tiny) a whole forward of
# one prompt took 37-79 ms with the scan at 256-2,048 tokens, 83-105 ms with fla-core
# (benchmarks/step_paths.py); 2,048 is also the default chunk.
SSD_SCAN_MAX_LEN = 2048


def ssd_varlen_scan(x, dt, dt_bias, dt_limit, A_log, B, C, D, chunk_size, seq_lens, ssm_pool, slots, cu_seqlens=None):
    """`ssd.ssd_varlen` by the recurrence itself (fast for short sequences)."""
    T, H, P = x.shape
    S = len(seq_lens)
    y = torch.empty((T, H, P), dtype=torch.float32, device=x.device)
    if S == 0 or T == 0:
        return y
    if cu_seqlens is None:
        cu_seqlens = cu_seqlens_of(seq_lens, x.device)
    _launch_scan(x, dt, dt_bias, dt_limit, A_log, B, C, D, ssm_pool, slots, y, cu_seqlens, S)
    return y


def ssd_verify(x, dt, dt_bias, dt_limit, A_log, B, C, D, rows, flat, ssm_pool, slots, states):
    """`verify.ssd_verify` in one launch (the scan kernel's VERIFY variant), over fixed [S, L]
    positions read from device memory (a verify graph can hold it); `flat` is implied by `rows`."""
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _launch_scan(x, dt, dt_bias, dt_limit, A_log, B, C, D, ssm_pool, slots, y, slots, rows.shape[0], (rows, states))
    return y
