"""Paged attention (prefill chunks with context, and decode; GQA folded into the row dimension) and
the KV store."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engram.ops.triton_ops.common import PDL_LAUNCH, cu_seqlens_of, np2, precision, wait_for_previous_kernel


# Not specialized, since they follow the step (a compiled variant per value class, which the warm-up
# cannot all reach): the block tables' row stride (the step's longest sequence in pages) and, when
# the keys are split, stride_ot and rows_per_split (its token count).
@triton.jit(do_not_specialize=["stride_ot", "stride_bs"])
def _paged_attention_kernel(
    Q,
    Kc,
    Vc,
    O,
    BT,
    Cu,
    Ctx,
    PSeq,
    PQs,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bs,
    stride_bp,
    scale,
    D,
    G: tl.constexpr,
    TPB: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DECODE: tl.constexpr,
    PREC: tl.constexpr,
    NSPLIT: tl.constexpr,
    Part,
    PartML,
    Hq,
):
    wait_for_previous_kernel()
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
        tl.store(
            O + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty), mask=rv[:, None] & dm[None, :]
        )


@triton.jit(do_not_specialize=["rows_per_split"])
def _attention_combine_kernel(Part, PartML, O, rows_per_split, Hq, stride_ot, stride_oh, D, NSPLIT: tl.constexpr, BLOCK_D: tl.constexpr):
    wait_for_previous_kernel()
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
        cu_seqlens = cu_seqlens_of(seq_lens, dev)
    if context_lens_t is None:
        context_lens_t = torch.tensor(context_lens, dtype=torch.int64, device=dev)
    decode = all(n == 1 for n in seq_lens)
    block_d = max(16, np2(D))
    if decode:
        block_m = max(16, np2(G))
        tpb = block_m // G
        grid = (S, Hkv)
        pseq = pqs = cu_seqlens  # unused
        block_n = 64
    else:
        block_m = 64 if G <= 64 else np2(G)
        tpb = block_m // G
        progs = _prefill_programs(tuple(seq_lens), tpb, dev)
        pseq, pqs = progs[0], progs[1]
        grid = (progs.shape[1], Hkv)
        block_n = 64
    # Few programs over long keys: split the keys too. A decode step splits by its batch size alone,
    # whatever the lengths, so that its CUDA graph serves every context length.
    programs = grid[0] * Hkv
    nsplit = 1
    target = ATTENTION_DECODE_TARGET_PROGRAMS if decode else ATTENTION_PREFILL_TARGET_PROGRAMS
    if programs < target and (decode or max(c + n for c, n in zip(context_lens, seq_lens)) >= ATTENTION_SPLIT_MIN_KEYS):
        nsplit = min(64, np2(target // programs))
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
            q,
            k_cache,
            v_cache,
            out,
            block_tables,
            cu_seqlens,
            context_lens_t,
            pseq,
            pqs,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            T * Hq,
            0,
            block_tables.stride(0),
            block_tables.stride(1),
            float(scaling),
            D,
            G=G,
            TPB=tpb,
            PAGE=block_size,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            DECODE=decode,
            PREC=precision(q),
            NSPLIT=nsplit,
            Part=part,
            PartML=part_ml,
            Hq=Hq,
            num_warps=4,
            num_stages=2,
            **PDL_LAUNCH,
        )
        _attention_combine_kernel[(T * Hq,)](
            part, part_ml, out, T * Hq, Hq, out.stride(0), out.stride(1), D, NSPLIT=nsplit, BLOCK_D=block_d, num_warps=4, **PDL_LAUNCH
        )
        return out
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_seqlens,
        context_lens_t,
        pseq,
        pqs,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        block_tables.stride(1),
        float(scaling),
        D,
        G=G,
        TPB=tpb,
        PAGE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DECODE=decode,
        PREC=precision(q),
        NSPLIT=1,
        Part=out,
        PartML=out,
        Hq=Hq,
        num_warps=4,
        num_stages=2,
        **PDL_LAUNCH,
    )
    return out


# When there are fewer (query block, KV head) programs than their target, decode steps and prefills
# whose keys reach ATTENTION_SPLIT_MIN_KEYS (a short turn on top of a long history) split the keys
# across programs, up to that many programs. For decode, 528 (4 per SM on the H200) was as fast as
# 264 or faster at every batch of 1-64 measured, and up to 1% faster with 1K-token contexts at
# batches 8-64 (BENCHMARKS.md, fifth session of 2026-11-30); prefills keep 264, as measured before.
ATTENTION_SPLIT_MIN_KEYS = 4096
ATTENTION_DECODE_TARGET_PROGRAMS = 528
ATTENTION_PREFILL_TARGET_PROGRAMS = 264


@triton.jit
def _store_kv_kernel(K, V, Kc, Vc, SlotMap, stride_k, stride_v, stride_kc, stride_vc, HD, BLOCK: tl.constexpr):
    wait_for_previous_kernel()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SlotMap + t).to(tl.int64)
    off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = off < HD
    k = tl.load(K + t * stride_k + off, mask=m, other=0.0)
    v = tl.load(V + t * stride_v + off, mask=m, other=0.0)
    ok = tl.where(slot >= 0, m, False)
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
    block = min(1024, np2(hd))
    _store_kv_kernel[(T, triton.cdiv(hd, block))](
        k2,
        v2,
        k_cache,
        v_cache,
        slot_mapping,
        k2.stride(0),
        v2.stride(0),
        k_cache.stride(0),
        v_cache.stride(0),
        hd,
        BLOCK=block,
        num_warps=4,
        **PDL_LAUNCH,
    )
