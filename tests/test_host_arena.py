"""The host arena cold loads read into (state/host_arena.py): disjoint page-aligned blocks that go
back when the last tensor viewing them dies, coalescing, misses when full; and the flag's check."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from engram.args import ServerArgs
from engram.state.host_arena import ALIGN, HostArena


def test_blocks_are_disjoint_aligned_and_hold_what_is_written():
    arena = HostArena(1 << 20, pin=False)
    a = arena.empty((1000, 3), torch.float32)  # 12,000 bytes: three pages
    b = arena.empty((7,), torch.bfloat16)
    assert a is not None and b is not None and arena.holds(a) and arena.holds(b)
    assert (b.data_ptr() - a.data_ptr()) % ALIGN == 0  # blocks start on pages of the arena (pinned memory starts on one)
    assert a.untyped_storage().nbytes() == 3 * ALIGN and b.untyped_storage().nbytes() == ALIGN  # each block's true size
    assert arena.used == 4 * ALIGN
    a.fill_(1.5)
    b.fill_(-2.0)
    assert bool((a == 1.5).all()) and bool((b == -2.0).all())  # neither block overlaps the other
    assert not arena.holds(torch.empty(4))


def test_a_block_comes_back_only_when_the_last_view_of_it_dies():
    arena = HostArena(1 << 20, pin=False)
    t = arena.empty((1024,), torch.float32)
    assert t is not None
    rows = t.view(32, 32)[3:9]  # a view of a view keeps the block
    del t
    gc.collect()
    assert arena.used == ALIGN
    del rows
    assert arena.used == 0


def test_freed_blocks_coalesce_and_a_full_arena_misses():
    arena = HostArena(5 * ALIGN, pin=False)  # rounded down to a power of two
    assert arena.capacity == 4 * ALIGN
    blocks = [arena.empty((ALIGN,), torch.uint8) for _ in range(4)]
    assert all(b is not None for b in blocks)
    assert arena.empty((1,), torch.uint8) is None and arena.misses == 1
    del blocks[2], blocks[1]  # two neighbours
    two = arena.empty((2 * ALIGN,), torch.uint8)
    assert two is not None and arena.used == 4 * ALIGN
    blocks.clear()
    del two
    assert arena.used == 0
    assert arena.empty((4 * ALIGN,), torch.uint8) is not None  # every range merged back into one


def test_blocks_freed_in_other_threads_come_back():
    arena = HostArena(1 << 16, pin=False)
    held = [arena.empty((ALIGN,), torch.uint8) for _ in range(8)]
    threads = [threading.Thread(target=held.pop) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert arena.used == 0
    assert arena.empty((arena.capacity,), torch.uint8) is not None


@pytest.mark.parametrize("gb", [-1.0, 1e-12])
def test_a_pinned_load_memory_too_small_is_refused_naming_the_flag(gb):
    with pytest.raises(ValueError, match="--pinned-load-memory-gb"):
        ServerArgs(pinned_load_memory_gb=gb)
