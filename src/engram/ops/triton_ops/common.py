"""What the Triton kernels share: sizes, the dot precision, rows of an input, and programmatic
dependent launch (PDL).

A mask that joins a block with a scalar condition (a padding slot, a repeated row) is written
`tl.where(cond, mask, False)`, not `mask & cond`: Triton's interpreter (TRITON_INTERPRET=1, which
runs tests/test_gpu_ops.py's kernel comparisons on the CPU) refuses the latter's dtype."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def np2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def precision(t: torch.Tensor) -> str:
    """Dot precision: exact float32 for float32 inputs (tests), native for half types."""
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _pdl_supported() -> bool:
    """Hopper or later, not Triton's CPU interpreter, not turned off with ENGRAM_DISABLE_PDL=1."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("ENGRAM_DISABLE_PDL") == "1" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


# Programmatic dependent launch (Hopper and later): every kernel of the package is launched while
# the one before it drains, so that the launch of each small kernel of a decode step overlaps the
# tail of the previous one. A kernel waits for the one before it (griddepcontrol.wait: it is
# complete and its writes are visible) before it writes anything or reads what that kernel may
# write. Before the wait it may read what the kernel just before it does not write: every earlier
# kernel is complete once every program of that one has passed its own wait, which is when the next
# one is let in. Read so: model weights (the GEMVs' first blocks, the norms' and the router's
# weights), the SSD update's state and parameters, the conv update's window and weights, the MoE
# down GEMV's routing (from the top-k kernel, two launches back), and the grouped MoE down
# projection's block of sorted pairs with their routing weights and its first weight tile (from the
# sort, two launches back). The grouped MoE up projection's shared-expert programs compute their
# whole tile (their input is from before the routing) and wait only to store it. The grouped MoE down
# projection waits for none of the up projection but the tiles it reads (`wait_for_tiles`), and
# each up program counts its tile as its last act, so the up projection has written all it will
# by the time the down projection is complete.
PDL = tl.constexpr(_pdl_supported())
PDL_LAUNCH = {"launch_pdl": True} if PDL else {}


@triton.jit
def wait_for_previous_kernel():
    if PDL:
        gdc_wait()
    let_next_kernel_launch()


@triton.jit
def let_next_kernel_launch():
    if PDL:
        gdc_launch_dependents()  # the next kernel may be scheduled once every program got here


@triton.jit
def tile_done(Done):
    """Count one finished tile at Done, after every thread's stores (a release: they are visible to
    the programs that see the count in `wait_for_tiles`)."""
    tl.debug_barrier()
    tl.atomic_add(Done, 1, sem="release", scope="gpu")


@triton.jit
def wait_for_tiles(Done, count):
    """In place of `wait_for_previous_kernel`, for a program that reads only some tiles of the kernel
    before: under PDL, wait until `count` of them are counted at Done (`tile_done`); then let the
    kernel after this one launch. Without PDL the kernel before is complete already. It cannot wait
    for a tile whose program has no SM to run on: the kernel before lets this one launch only once
    every one of its programs has started."""
    if PDL:
        while _load_acquire(Done) < count:
            pass
    let_next_kernel_launch()


@triton.jit
def _load_acquire(ptr):
    """*ptr, read with acquire semantics (the reads after it see what was written before the release)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def verify_row(Rows, stride_rs, s, i, VERIFY: tl.constexpr):
    """The flat row of step i of sequence s in a token-by-token scan: Rows[s, i] in a verify step
    (its positions laid out [S, L], ops/verify.py), else i itself."""
    t = i
    if VERIFY:
        t = tl.load(Rows + s * stride_rs + i).to(tl.int64)
    return t


@triton.jit
def keep_verified(y_ptr, y, y_mask, t, last, state_ptr, st, state_mask):
    """A verify step's output of flat row t (unless row `last`, stored before it: a position past
    the sequence's length repeats its last row) and its state after the position, stored rounded to
    the buffer's dtype; returns that state as float32, carried on rounded as decode steps carry it."""
    tl.store(y_ptr, y, mask=tl.where(t != last, y_mask, False))
    kept = st.to(state_ptr.dtype.element_ty)
    tl.store(state_ptr, kept, mask=state_mask)
    return kept.to(tl.float32)


def verify_args(verify: tuple[torch.Tensor, torch.Tensor] | None, slots: torch.Tensor, out: torch.Tensor) -> tuple:
    """The VERIFY arguments of a token-by-token scan kernel (triton_ops/ssd.py, gated_delta.py):
    Rows, States, Rows' sequence stride, States' strides of its first four dims, L. `verify` is
    (rows [S, L], states [S, L, H, ., .]); None: stand-ins the kernel does not read (slots, out)."""
    rows, states = verify if verify is not None else (slots, out.view(1, *out.shape, 1))
    assert rows.stride(-1) == 1 and states.stride(-1) == 1
    return rows, states, rows.stride(0), *(states.stride(i) for i in range(4)), rows.shape[-1] if verify is not None else 0


def cu_seqlens_of(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int64, device=device)


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
