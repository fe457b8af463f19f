"""A decode graph's first op: the inputs the host staged for this replay, read from pinned host
memory (ops/staging.py says how the two buffers take turns)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engram.ops import staging as staging_ref
from engram.ops.triton_ops.common import np2

TAKE_BLOCK = 1024  # int32 words a program copies per pass
# Every program reads the length over PCIe: a program per SM (132 on the H200) made a replay about
# 20 us longer than 16 programs do, with the tables of a 128K-token context.
TAKE_PROGRAMS = 16


@triton.jit
def _take_decode_inputs_kernel(
    Staged,
    Inputs,
    Turn,
    Sampled,
    InputIds,
    stride_staged,
    rows_words,
    columns,
    b,
    HEADER: tl.constexpr,
    TOKEN_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Programs copy blocks of staged[Turn[0] % 2] in a grid-stride loop: the rows (always staged)
    read beside the length, to save a round trip over PCIe, the tables after it (only what was
    staged: every word read over PCIe costs). Program 0 also gathers the tokens. The last program
    to finish counts the replay, once every program has read the count."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    count = tl.load(Turn)
    parity = count % 2
    src = Staged + parity * stride_staged
    words = src + HEADER
    i = pid * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(words + i, mask=i < rows_words)
    n = tl.load(src.to(tl.pointer_type(tl.int64)))
    tl.store(Inputs + i, rows, mask=i < rows_words)
    for start in range(pid * BLOCK, n, programs * BLOCK):
        j = start + tl.arange(0, BLOCK)
        tables = (j >= rows_words) & (j < n)
        tl.store(Inputs + j, tl.load(words + j, mask=tables), mask=tables)
    if pid == 0:
        r = tl.arange(0, BLOCK_B)
        token_rows = words.to(tl.pointer_type(tl.int64))
        sent = tl.load(token_rows + r, mask=r < b)
        where = tl.load(token_rows + TOKEN_ROW * columns + r, mask=r < b, other=-1)
        token = tl.load(Sampled + where, mask=where >= 0)
        tl.store(InputIds + r, tl.where(where >= 0, token, sent), mask=r < b)
        tl.store(Turn + 1, parity)
    tl.debug_barrier()
    if tl.atomic_add(Turn + 2, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.store(Turn + 2, 0)
        tl.store(Turn, count + 1)


def take_decode_inputs(
    staged: torch.Tensor, inputs: torch.Tensor, turn: torch.Tensor, sampled: torch.Tensor, input_ids: torch.Tensor, columns: int
) -> None:
    """As the reference; `staged` in pinned host memory (or on the CPU for the interpreter)."""
    laid_out = staged.dtype == inputs.dtype == torch.int32 and sampled.dtype == input_ids.dtype == torch.int64
    contiguous = staged.is_contiguous() and inputs.is_contiguous() and input_ids.is_contiguous()
    if not (laid_out and contiguous and (staged.is_pinned() or not inputs.is_cuda)):
        return staging_ref.take_decode_inputs(staged, inputs, turn, sampled, input_ids, columns)
    capacity = staged.shape[1] - staging_ref.HEADER_WORDS
    programs = max(1, min(TAKE_PROGRAMS, triton.cdiv(capacity, TAKE_BLOCK)))
    _take_decode_inputs_kernel[(programs,)](
        staged,
        inputs,
        turn,
        sampled,
        input_ids,
        staged.stride(0),
        2 * (staging_ref.TOKEN_ROW + 1) * columns,
        columns,
        input_ids.shape[0],
        HEADER=staging_ref.HEADER_WORDS,
        TOKEN_ROW=staging_ref.TOKEN_ROW,
        BLOCK=TAKE_BLOCK,
        BLOCK_B=np2(input_ids.shape[0]),
        num_warps=4,
    )
