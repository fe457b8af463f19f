"""Sampling: the greedy token (torch's argmax of one long row runs in one thread block)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engram.ops import sample as sample_ref
from engram.ops.triton_ops.common import PDL_LAUNCH, TL_DTYPES, as_rows, np2, wait_for_previous_kernel


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
    wait_for_previous_kernel()
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    i = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(L + r * stride_l + i, mask=i < V, other=float("-inf")).to(tl.float32)
    m, first = _first_max(x, i)
    tl.store(Val + r * NC + c, m)
    tl.store(Idx + r * NC + c, first)


@triton.jit
def _argmax_rows_kernel(Val, Idx, Out, HostOut, Turn, stride_host, NC, BLOCK_C: tl.constexpr, TO_HOST: tl.constexpr):
    """Row r's argmax from its chunks' (value, first index): the first chunk with the largest value;
    with TO_HOST also into row Turn[1] of HostOut, written through to host memory."""
    wait_for_previous_kernel()
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    v = tl.load(Val + r * NC + c, mask=c < NC, other=float("-inf"))
    i = tl.load(Idx + r * NC + c, mask=c < NC, other=2**31 - 1)
    chunk = _first_max(v, c)[1]
    token = tl.sum(tl.where(c == chunk, i, 0), axis=0).to(tl.int64)
    tl.store(Out + r, token)
    if TO_HOST:
        tl.store(HostOut + tl.load(Turn + 1) * stride_host + r, token, cache_modifier=".wt")


ARGMAX_CHUNK = 4096


def argmax(
    logits: torch.Tensor, out: torch.Tensor | None = None, host_out: torch.Tensor | None = None, turn: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows [R, V] of float32 or half logits into a contiguous int64 `out` of R (or a new one), and
    into row turn[1] of a pinned `host_out` (see the reference); anything else goes to the reference."""
    shaped = logits.dim() == 2 and logits.shape[1] > 0 and logits.dtype in TL_DTYPES
    to_host = host_out is not None
    if (
        not shaped
        or (out is not None and (out.dtype != torch.int64 or out.shape != logits.shape[:1] or not out.is_contiguous()))
        or (host_out is not None and not (host_out.dtype == torch.int64 and host_out.stride(1) == 1 and (host_out.is_pinned() or not logits.is_cuda)))
    ):
        return sample_ref.argmax(logits, out=out, host_out=host_out, turn=turn)
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int64, device=logits.device) if out is None else out
    if R == 0:
        return out
    x = as_rows(logits)
    nc = triton.cdiv(V, ARGMAX_CHUNK)
    val = torch.empty((R, nc), dtype=torch.float32, device=x.device)
    idx = torch.empty((R, nc), dtype=torch.int32, device=x.device)
    _argmax_chunk_kernel[(R, nc)](x, val, idx, x.stride(0), V, nc, BLOCK=ARGMAX_CHUNK, num_warps=8, **PDL_LAUNCH)
    host = (host_out, turn, host_out.stride(0)) if host_out is not None else (out, out, 0)
    _argmax_rows_kernel[(R,)](val, idx, out, *host, nc, BLOCK_C=np2(nc), num_warps=1, TO_HOST=to_host, **PDL_LAUNCH)
    return out
