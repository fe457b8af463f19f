"""Mixture of experts: the router's softmax top-k, the routed pairs sorted by expert, and the
experts as GEMVs per pair (small batch) or a grouped GEMM over expert-sorted blocks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engram.ops import moe as moe_ref
from engram.ops.triton_ops.blocks import GEMV_CONFIG
from engram.ops.triton_ops.common import PDL_LAUNCH, as_rows, np2, precision, tile_done, wait_for_previous_kernel, wait_for_tiles
from engram.ops.triton_ops.linear import dot_rows, dot_tile, first_dot, grouped_dot, weight_block
from engram.ops.triton_ops.norm import silu_and_mul

# Integer arguments that follow a step's size (tokens, routed pairs, blocks of pairs): Triton would
# compile a variant for each of their values equal to 1 or divisible by 16, which the warm-up cannot
# all reach (they are products of the token count), so they are not specialized.
_STEP_SIZED = ["Tk", "T", "NB"]


@triton.jit
def _softmax_topk_rows(x, valid, TOPK: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """The TOPK largest entries of each row of x [ROWS, BLOCK_E] where `valid` (the first index of
    ties first), and their softmax: (weights float32, ids int32), each [ROWS, BLOCK_K], zero past TOPK.
    NaN (a CUDA-graph padding row holds whatever was in memory) must still pick distinct valid
    experts: it counts as -inf, and an expert once taken is not a candidate again even then."""
    e = tl.arange(0, BLOCK_E)[None, :]
    kk = tl.arange(0, BLOCK_K)[None, :]
    x = tl.where(x == x, x, float("-inf"))
    free = valid
    vals = tl.full([ROWS, BLOCK_K], float("-inf"), dtype=tl.float32)
    idxs = tl.zeros([ROWS, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        m = tl.max(tl.where(free, x, float("-inf")), axis=1)
        i = tl.min(tl.where(free & (x == m[:, None]), e, BLOCK_E), axis=1)
        vals = tl.where(kk == j, m[:, None], vals)
        idxs = tl.where(kk == j, i[:, None], idxs)
        free = free & (e != i[:, None])
    mx = tl.max(vals, axis=1)
    p = tl.where(kk < TOPK, tl.exp(vals - mx[:, None]), 0.0)
    return p / tl.sum(p, axis=1)[:, None], idxs


@triton.jit
def _topk_softmax_kernel(L, Wt, Ids, stride_l, E, TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's row of router logits per program, as a [1, BLOCK_E] tile."""
    wait_for_previous_kernel()
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)[None, :]
    x = tl.load(L + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p, idxs = _softmax_topk_rows(x, e < E, TOPK, 1, BLOCK_E, BLOCK_K)
    kk = tl.arange(0, BLOCK_K)[None, :]
    tl.store(Wt + t * TOPK + kk, p, mask=kk < TOPK)
    tl.store(Ids + t * TOPK + kk, idxs.to(tl.int64), mask=kk < TOPK)


def route_softmax_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = router_logits.shape
    assert 0 < top_k <= E, f"top-{top_k} of {E} experts"
    weights = torch.empty((T, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=router_logits.device)
    if T:
        logits = as_rows(router_logits)
        _topk_softmax_kernel[(T,)](
            logits, weights, ids, logits.stride(0), E, TOPK=top_k, BLOCK_E=np2(E), BLOCK_K=np2(top_k), num_warps=1, **PDL_LAUNCH
        )
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
def _expert_up(
    x_ptr,
    w_ptr,
    h_ptr,
    stride_wn,
    nb,
    I,
    HDIM: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    WAIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows nb*BLOCK_N.. of one expert's hidden act(W_gate x) * (W_up x), rounded as the reference.
    WAIT: wait for the previous kernel here, once the first weight loads are issued."""
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    dt = h_ptr.dtype.element_ty
    w_gate = weight_block(w_ptr, n, nm, stride_wn, 0, HDIM, BLOCK_K)
    w_up = weight_block(w_ptr + I * stride_wn, n, nm, stride_wn, 0, HDIM, BLOCK_K) if GATED else w_gate
    if WAIT:
        wait_for_previous_kernel()
    g = dot_rows(x_ptr, w_ptr, n, nm, stride_wn, w_gate, HDIM, BLOCK_K).to(dt).to(tl.float32)
    h = _act(g, ACT).to(dt).to(tl.float32)
    if GATED:
        h = h * dot_rows(x_ptr, w_ptr + I * stride_wn, n, nm, stride_wn, w_up, HDIM, BLOCK_K).to(dt).to(tl.float32)
    tl.store(h_ptr + n, h.to(dt), mask=nm)


@triton.jit
def _moe_up_gemv_kernel(
    X,
    Win,
    Ids,
    H1,
    Sin,
    Hs,
    stride_x,
    stride_we,
    stride_wn,
    stride_h,
    stride_sn,
    stride_hs,
    TK,
    I,
    IS,
    HDIM: tl.constexpr,
    TOPK: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A flat grid: first every routed (token, expert) pair's row blocks, then (with a shared
    expert) every token's row blocks of the shared expert, whose first weights are read before
    the wait (the routed ones need the routing, which the previous kernel writes)."""
    pid = tl.program_id(0).to(tl.int64)
    nbi = tl.cdiv(I, BLOCK_N)
    if pid < TK * nbi:
        wait_for_previous_kernel()
        a = pid // nbi
        e = tl.load(Ids + a).to(tl.int64)
        _expert_up(
            X + (a // TOPK) * stride_x, Win + e * stride_we, H1 + a * stride_h, stride_wn, pid % nbi, I, HDIM, GATED, ACT, False, BLOCK_N, BLOCK_K
        )
    else:
        q = pid - TK * nbi
        nbs = tl.cdiv(IS, BLOCK_N)
        t = q // nbs
        _expert_up(X + t * stride_x, Sin, Hs + t * stride_hs, stride_sn, q % nbs, IS, HDIM, GATED, ACT, True, BLOCK_N, BLOCK_K)


@triton.jit
def _moe_down_gemv_kernel(
    H1,
    Wout,
    Ids,
    Wts,
    Out,
    Hs,
    Sout,
    stride_h,
    stride_we,
    stride_wn,
    stride_o,
    stride_hs,
    stride_sn,
    HDIM: tl.constexpr,
    I: tl.constexpr,
    IS: tl.constexpr,
    TOPK: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KS: tl.constexpr,
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
        s_first = weight_block(Sout, n, nm, stride_sn, 0, IS, BLOCK_KS)
    wait_for_previous_kernel()
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
        shared = dot_rows(Hs + t * stride_hs, Sout, n, nm, stride_sn, s_first, IS, BLOCK_KS)
        out = out.to(dt).to(tl.float32) + shared.to(dt).to(tl.float32)
    tl.store(Out + t * stride_o + n, out.to(dt), mask=nm)


@triton.jit
def _grouped_up_tile(
    X,
    W,
    H,
    x_rows,
    h_rows,
    rv,
    nb,
    stride_x,
    stride_wn,
    stride_h,
    Hdim,
    I,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    WAIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
):
    """H[h_rows, block nb] = act(X[x_rows] W_gate^T) * (X[x_rows] W_up^T), rounded as the reference.
    WAIT: wait for the previous kernel before the store (the caller has not waited)."""
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    dt = H.dtype.element_ty
    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g = grouped_dot(X, W, x_rows, rv, n, nm, stride_x, stride_wn, Hdim, zero, BLOCK_K, PREC)
    h = _act(g.to(dt).to(tl.float32), ACT).to(dt).to(tl.float32)
    if GATED:
        h = h * grouped_dot(X, W + I * stride_wn, x_rows, rv, n, nm, stride_x, stride_wn, Hdim, zero, BLOCK_K, PREC).to(dt).to(tl.float32)
    if WAIT:
        wait_for_previous_kernel()
    tl.store(H + h_rows[:, None] * stride_h + n[None, :], h.to(dt), mask=rv[:, None] & nm[None, :])


@triton.jit(do_not_specialize=_STEP_SIZED + ["SHARED_PROGRAMS"])
def _moe_up_grouped_kernel(
    X,
    Win,
    SortedIds,
    BlockExpert,
    H1,
    Sin,
    Hs,
    Done,
    stride_x,
    stride_we,
    stride_wn,
    stride_h,
    stride_sn,
    stride_hs,
    Tk,
    T,
    Hdim,
    I,
    IS,
    E,
    NB,
    SHARED_PROGRAMS,
    TOPK: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
):
    """A flat grid: first (with a shared expert, IS > 0) blocks of BLOCK_M tokens through the
    shared expert, whose hidden size may differ; then (block b, column block nb) for every block
    of the routed pairs sorted by expert (b fastest). The shared programs need nothing that the
    previous kernel (the routing's sort, which `moe_experts` launches itself after X is written)
    writes: they compute their tile while it runs and wait only to store it. Each program then counts
    its tile at Done (its block; a shared one at NB + its token block) for the down projection. The
    count's index is taken from the program id again after the tile: kept through the K loop, it
    took the kernel from 54 to 64 registers a thread, 8 programs a SM instead of 9 (ptxas, sm_90a)."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < SHARED_PROGRAMS:
        sb = tl.cdiv(T, BLOCK_M)
        t = (pid % sb) * BLOCK_M + tl.arange(0, BLOCK_M)
        _grouped_up_tile(
            X, Sin, Hs, t, t, t < T, pid // sb, stride_x, stride_sn, stride_hs, Hdim, IS, GATED, ACT, True, BLOCK_M, BLOCK_N, BLOCK_K, PREC
        )
        tile_done(Done + NB + tl.program_id(0) % sb)
    else:
        wait_for_previous_kernel()
        q = pid - SHARED_PROGRAMS
        b = q % NB
        e = tl.load(BlockExpert + b).to(tl.int64)
        if e >= E:
            return
        rows = tl.load(SortedIds + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        _grouped_up_tile(
            X,
            Win + e * stride_we,
            H1,
            rows // TOPK,
            rows,
            rows < Tk,
            q // NB,
            stride_x,
            stride_wn,
            stride_h,
            Hdim,
            I,
            GATED,
            ACT,
            False,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            PREC,
        )
        tile_done(Done + (tl.program_id(0) - SHARED_PROGRAMS) % NB)


@triton.jit(do_not_specialize=_STEP_SIZED)
def _moe_down_grouped_kernel(
    H1,
    Wout,
    SortedIds,
    BlockExpert,
    Wts,
    O2,
    Hs,
    Sout,
    S,
    Done,
    stride_h,
    stride_we,
    stride_wn,
    stride_o,
    stride_hs,
    stride_sn,
    stride_s,
    Tk,
    T,
    Hdim,
    I,
    IS,
    E,
    NB,
    UP_TILES,
    SHARED_UP_TILES,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
):
    """Routed blocks: O2[pair] = weight * (W_down h), each rounded as the reference (so O2 holds them
    exactly in the model's dtype); then (with a shared expert) S[token] = W_shared_down h_shared.
    A routed block reads its expert, pairs, routing weights and first weight tile before it waits:
    the routing and its sort are from launches before the previous one. Each program waits only for
    the up projection's tiles of its block (`wait_for_tiles`), not for the whole kernel: the up
    projection's programs end over its last microseconds as their SMs drain, and the down
    projection's first programs run in that time (BENCHMARKS.md, twelfth session)."""
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
        wt = tl.load(Wts + rows, mask=rv, other=0.0).to(dt).to(tl.float32)
        w0 = dot_tile(Wout + e * stride_we, n, nm, stride_wn, 0, I, BLOCK_K)
        wait_for_tiles(Done + b, UP_TILES)
        acc = first_dot(H1, w0, rows, rv, stride_h, I, zero, BLOCK_K, PREC)
        acc = grouped_dot(H1, Wout + e * stride_we, rows, rv, n, nm, stride_h, stride_wn, I, acc, BLOCK_K, PREC, BLOCK_K)
        o = (acc.to(dt).to(tl.float32) * wt[:, None]).to(dt).to(tl.float32)
        tl.store(O2 + rows[:, None] * stride_o + n[None, :], o, mask=rv[:, None] & nm[None, :])
    else:
        wait_for_tiles(Done + b, SHARED_UP_TILES)
        t = (b - NB) * BLOCK_M + tl.arange(0, BLOCK_M)
        tv = t < T
        acc = grouped_dot(Hs, Sout, t, tv, n, nm, stride_hs, stride_sn, IS, zero, BLOCK_K, PREC)
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
def _align_pairs(
    ids, a, invalid, SortedIds, BlockExpert, Done, NDONE, Tk, NB, MAXP, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr
):
    """This program's part of `moe_align` (program e < E: expert e's run; program E: the tail) from
    the experts `ids` of the pairs `a` in increasing order (a 1-D block; `invalid` of its entries
    are no pairs and hold expert 0): every program counts all pairs per expert (a histogram),
    takes its padded offset, and scatters its pairs there in order (ranks by a cumulative sum),
    then pads its run and marks its blocks. The last program pads the space past the last run and
    zeroes the NDONE tile counts at Done (`tile_done`)."""
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
        for d0 in range(0, NDONE, CHUNK):
            d = d0 + tl.arange(0, CHUNK)
            tl.store(Done + d, tl.zeros([CHUNK], dtype=tl.int32), mask=d < NDONE)


@triton.jit(do_not_specialize=_STEP_SIZED + ["NDONE", "MAXP"])
def _moe_align_kernel(
    Ids,
    SortedIds,
    BlockExpert,
    Done,
    NDONE,
    Tk,
    NB,
    MAXP,
    E,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """`moe_align`, one program per expert and one more for the tail (`_align_pairs`)."""
    wait_for_previous_kernel()
    a = tl.arange(0, BLOCK_T)
    ids = tl.load(Ids + a, mask=a < Tk, other=0).to(tl.int32)
    _align_pairs(ids, a, BLOCK_T - Tk, SortedIds, BlockExpert, Done, NDONE, Tk, NB, MAXP, E, BLOCK_M, BLOCK_E, CHUNK)


@triton.jit(do_not_specialize=["NDONE", "T", "NB", "MAXP"])
def _topk_align_kernel(
    L,
    Wt,
    Ids,
    SortedIds,
    BlockExpert,
    Done,
    NDONE,
    stride_l,
    T,
    NB,
    MAXP,
    E,
    TOPK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """`route_softmax_topk` of all T rows and `moe_align` of their pairs in one launch: each of the
    E + 1 programs takes the top-k of every row (`_softmax_topk_rows`), program 0 stores the weights
    and ids, and each then does its part of the sort (`_align_pairs`)."""
    wait_for_previous_kernel()
    t = tl.arange(0, BLOCK_T)
    tm = t < T
    e = tl.arange(0, BLOCK_E)
    logit = tm[:, None] & (e < E)[None, :]
    x = tl.load(L + t[:, None] * stride_l + e[None, :], mask=logit, other=float("-inf")).to(tl.float32)
    p, idxs = _softmax_topk_rows(x, logit, TOPK, BLOCK_T, BLOCK_E, BLOCK_K)
    kk = tl.arange(0, BLOCK_K)
    pair = t[:, None] * TOPK + kk[None, :]
    valid = tm[:, None] & (kk[None, :] < TOPK)
    if tl.program_id(0) == 0:
        tl.store(Wt + pair, p, mask=valid)
        tl.store(Ids + pair, idxs.to(tl.int64), mask=valid)
    ids = tl.reshape(tl.where(valid, idxs, 0), [BLOCK_T * BLOCK_K])
    a = tl.reshape(tl.where(valid, pair, T * TOPK), [BLOCK_T * BLOCK_K])  # invalid entries: past every pair
    _align_pairs(ids, a, BLOCK_T * BLOCK_K - T * TOPK, SortedIds, BlockExpert, Done, NDONE, T * TOPK, NB, MAXP, E, BLOCK_M, BLOCK_E, CHUNK)


MOE_ALIGN_KERNEL_MAX_PAIRS = 4096


def _block_count(tk: int, num_experts: int, block_m: int) -> int:
    """Blocks of `moe_align`'s output: every expert's run padded to a multiple of block_m."""
    return triton.cdiv(tk + min(num_experts, tk) * (block_m - 1), block_m)


def _sorted_pairs(tk: int, num_experts: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align`'s outputs, uninitialized: sorted pair ids [max_padded], block experts [blocks]."""
    blocks = _block_count(tk, num_experts, block_m)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int64, device=device)
    return sorted_ids, torch.empty(blocks, dtype=torch.int64, device=device)


def moe_align_triton(ids: torch.Tensor, num_experts: int, block_m: int, done: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align` as one launch (small batches: decode steps, short prefill chunks); zeroes the
    grouped GEMM's tile counts `done` on the way."""
    flat = ids.reshape(-1).contiguous()
    tk = flat.numel()
    sorted_ids, block_expert = _sorted_pairs(tk, num_experts, block_m, ids.device)
    _moe_align_kernel[(num_experts + 1,)](
        flat,
        sorted_ids,
        block_expert,
        done,
        done.numel(),
        tk,
        block_expert.numel(),
        sorted_ids.numel(),
        num_experts,
        BLOCK_M=block_m,
        BLOCK_E=np2(num_experts),
        BLOCK_T=np2(tk),
        CHUNK=128,
        num_warps=4,
        **PDL_LAUNCH,
    )
    return sorted_ids, block_expert


# Router logits per launch up to which `softmax_topk_experts` takes the top-k and sorts the pairs in
# one launch (each program holds all of them). On the H200 with 64 experts, one launch saved 4% of a
# step at 8 tokens and cost 0.4-3% at 16-64 (BENCHMARKS.md), where each program's top-k of all rows
# outweighs the launch it saves.
TOPK_ALIGN_MAX_LOGITS = 512


def route_softmax_topk_align(router_logits: torch.Tensor, top_k: int, block_m: int, done: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`route_softmax_topk` and `moe_align` of its pairs in one launch: (weights, ids, sorted ids, block
    experts); zeroes the grouped GEMM's tile counts `done` on the way."""
    T, E = router_logits.shape
    assert 0 < top_k <= E, f"top-{top_k} of {E} experts"
    logits = as_rows(router_logits)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    sorted_ids, block_expert = _sorted_pairs(T * top_k, E, block_m, logits.device)
    _topk_align_kernel[(E + 1,)](
        logits,
        weights,
        ids,
        sorted_ids,
        block_expert,
        done,
        done.numel(),
        logits.stride(0),
        T,
        block_expert.numel(),
        sorted_ids.numel(),
        E,
        TOPK=top_k,
        BLOCK_T=np2(T),
        BLOCK_E=np2(E),
        BLOCK_K=np2(top_k),
        BLOCK_M=block_m,
        CHUNK=128,
        num_warps=4,
        **PDL_LAUNCH,
    )
    return weights, ids, sorted_ids, block_expert


# Up to this many routed (token, expert) pairs, each pair is its own GEMV (decode at small batch:
# fewer launches, each expert's weights read once per pair); above it, the grouped GEMM.
MOE_GEMV_MAX_PAIRS = 32
# Up to this many, the grouped GEMM takes the tuned blocks of GEMV_CONFIG and runs the shared expert
# as extra programs of its two launches; above it (prefill), larger blocks and cuBLAS for the shared expert.
MOE_GROUPED_SMALL_PAIRS = 2048


@triton.jit
def _moe_combine_kernel(O2, S, Out, stride_o, stride_s, stride_out, HDIM, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum of the token's TOPK weighted expert rows (in float32), rounded, + its shared row."""
    wait_for_previous_kernel()
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
        weights, ids = route()
        return moe_ref.moe_experts(x, w_in, w_out, weights, ids, act, gated, shared)
    T, Hdim = x.shape
    E, I = w_out.shape[0], w_out.shape[2]
    tk = T * top_k
    out = torch.empty((T, Hdim), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x = as_rows(x)
    assert w_in.stride(-1) == 1 and w_out.stride(-1) == 1
    h1 = torch.empty((tk, I), dtype=x.dtype, device=x.device)
    if tk <= MOE_GEMV_MAX_PAIRS and Hdim <= 8192 and I <= 8192:
        weights, ids = route()
        return _moe_gemv(x, w_in, w_out, weights.contiguous(), ids.contiguous(), code, gated, shared, h1, out)
    small = tk <= MOE_GROUPED_SMALL_PAIRS
    bm, bn, bk, warps, stages = GEMV_CONFIG["moe_grouped_up"] if small else (64, 128, 64, 8, 3)
    dbn, dbk, dwarps, dstages = GEMV_CONFIG["moe_grouped_down"] if small else (128, 64, 8, 3)
    # Small batches run the shared expert as extra programs of the two grouped launches; large
    # ones (prefill) through cuBLAS, which is faster there than this GEMM.
    fuse_shared = shared is not None and small
    shared_blocks = triton.cdiv(T, bm) if fuse_shared else 0
    # Finished up-projection tiles per block of pairs (then per block of tokens of the shared expert):
    # a down-projection program starts once its block's are all done (`wait_for_tiles`).
    done = torch.empty(_block_count(tk, E, bm) + shared_blocks, dtype=torch.int32, device=x.device)
    if router_logits is not None and np2(T) * np2(E) <= TOPK_ALIGN_MAX_LOGITS and E <= 512:
        weights, ids, sorted_ids, block_expert = route_softmax_topk_align(router_logits, top_k, bm, done)
    else:
        weights, ids = route()
        weights, ids = weights.contiguous(), ids.contiguous()
        if tk <= MOE_ALIGN_KERNEL_MAX_PAIRS and E <= 512:
            sorted_ids, block_expert = moe_align_triton(ids, E, bm, done)
        else:
            sorted_ids, block_expert = moe_align(ids, E, bm)
            done.zero_()
    nblocks = block_expert.numel()
    prec = precision(x)
    s_in, s_out = shared if fuse_shared else (w_in[0], w_out[0])  # unused stand-ins when not fused
    i_s = s_out.shape[1] if fuse_shared else 0
    hs = torch.empty((T, max(i_s, 1)), dtype=x.dtype, device=x.device)
    s = torch.empty((T, Hdim), dtype=x.dtype, device=x.device) if fuse_shared else None
    shared_programs = shared_blocks * triton.cdiv(i_s, bn)
    _moe_up_grouped_kernel[(shared_programs + nblocks * triton.cdiv(I, bn),)](
        x,
        w_in,
        sorted_ids,
        block_expert,
        h1,
        s_in,
        hs,
        done,
        x.stride(0),
        w_in.stride(0),
        w_in.stride(1),
        h1.stride(0),
        s_in.stride(0),
        hs.stride(0),
        tk,
        T,
        Hdim,
        I,
        i_s,
        E,
        nblocks,
        shared_programs,
        TOPK=top_k,
        GATED=gated,
        ACT=code,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        PREC=prec,
        num_warps=warps,
        num_stages=stages,
        **PDL_LAUNCH,
    )
    o2 = torch.empty((tk, Hdim), dtype=x.dtype, device=x.device)
    _moe_down_grouped_kernel[(nblocks + shared_blocks, triton.cdiv(Hdim, dbn))](
        h1,
        w_out,
        sorted_ids,
        block_expert,
        weights.reshape(-1),
        o2,
        hs,
        s_out,
        s if fuse_shared else o2,
        done,
        h1.stride(0),
        w_out.stride(0),
        w_out.stride(1),
        o2.stride(0),
        hs.stride(0),
        s_out.stride(0),
        Hdim,  # S is contiguous [T, Hdim]
        tk,
        T,
        Hdim,
        I,
        max(i_s, 1),
        E,
        nblocks,
        triton.cdiv(I, bn),
        triton.cdiv(i_s, bn),
        BLOCK_M=bm,
        BLOCK_N=dbn,
        BLOCK_K=dbk,
        PREC=prec,
        num_warps=dwarps,
        num_stages=dstages,
        **PDL_LAUNCH,
    )
    if shared is not None and not fuse_shared:
        s = _shared_expert(x, shared, act, gated)
    s_arg = s if s is not None else o2
    block = min(256, np2(Hdim))
    _moe_combine_kernel[(T, triton.cdiv(Hdim, block))](
        o2,
        s_arg,
        out,
        o2.stride(0),
        s_arg.stride(0),
        out.stride(0),
        Hdim,
        TOPK=top_k,
        HAS_SHARED=shared is not None,
        BLOCK=block,
        num_warps=2,
        **PDL_LAUNCH,
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
        x,
        w_in,
        ids,
        h1,
        s_in,
        hs,
        x.stride(0),
        w_in.stride(0),
        w_in.stride(1),
        h1.stride(0),
        s_in.stride(0),
        hs.stride(0),
        tk,
        I,
        i_s,
        HDIM=Hdim,
        TOPK=top_k,
        GATED=gated,
        ACT=code,
        BLOCK_N=bn,
        BLOCK_K=min(bk, np2(Hdim)),
        num_warps=warps,
        **PDL_LAUNCH,
    )
    bn, bk, warps = GEMV_CONFIG["moe_down"]
    _moe_down_gemv_kernel[(T, triton.cdiv(Hdim, bn))](
        h1,
        w_out,
        ids,
        weights,
        out,
        hs,
        s_out,
        h1.stride(0),
        w_out.stride(0),
        w_out.stride(1),
        out.stride(0),
        hs.stride(0),
        s_out.stride(0),
        HDIM=Hdim,
        I=I,
        IS=max(i_s, 1),
        TOPK=top_k,
        HAS_SHARED=shared is not None,
        BLOCK_J=np2(top_k),
        BLOCK_N=bn,
        BLOCK_K=min(bk, np2(I)),
        BLOCK_KS=min(bk, np2(i_s)),
        num_warps=warps,
        **PDL_LAUNCH,
    )
    return out
