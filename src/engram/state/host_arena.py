"""Page-locked host memory taken once, at start-up, and lent in blocks to the loads that read
states into it.

Page-locking memory costs about as much as reading it from a fast disk: on the H200 box ~630 ms
of a 1,539 ms cold restore of 0.9 GB went to torch's pinned allocations, which a fresh process
(every restore after a restart) makes anew for each load. Here the locking is paid once; a load
takes blocks for the tensors it reads, so they are pinned from their first byte (device copies
from them do not block the host, and the WARM tier's copy of the state is pinned) and nothing on
the request's path page-locks. As in LMCache's and SGLang HiCache's pinned pools: one
allocation, sub-allocated first fit.

A block is owned by the storage of the tensor made from it: it returns to the arena when the last
tensor viewing it is freed, so whoever holds the state (the WARM tier, a running request, the
prefix cache) decides its life as for any tensor, and the WARM tier's byte count (storages) sees
each block at its true size.
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref
from collections import deque

import torch

ALIGN = 4096  # every block starts on a page


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostArena:
    """`capacity` bytes of host memory, rounded down to a power of two (torch's pinned allocator
    rounds up to one: memory no block could use), page-locked if `pin`. Thread-safe."""

    def __init__(self, capacity: int, pin: bool):
        if capacity < ALIGN:
            raise ValueError(f"a host arena needs at least {ALIGN} bytes, got {capacity}")
        self.capacity = 1 << (capacity.bit_length() - 1)
        self.pinned = pin
        self._memory = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pin).numpy()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), by offset, never adjacent
        self._returned: deque[tuple[int, int]] = deque()  # freed blocks, merged into `_free` under the lock
        self._lock = threading.Lock()
        self._used = 0
        self.misses = 0  # blocks asked for that did not fit

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialized tensor in a block of the arena; None when no free block is large enough."""
        nbytes = dtype.itemsize * math.prod(shape)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        size = _aligned(nbytes)
        with self._lock:
            self._merge_returned()
            found = next((i for i, (_, free) in enumerate(self._free) if free >= size), None)
            if found is None:
                self.misses += 1
                return None
            offset, free = self._free[found]
            if free == size:
                del self._free[found]
            else:
                self._free[found] = (offset + size, free - size)
            self._used += size
        block = self._memory[offset : offset + size]  # a view; its death gives the block back
        weakref.finalize(block, self._returned.append, (offset, size))
        return torch.frombuffer(block, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether the tensor's memory lies in the arena."""
        start = self._memory.ctypes.data
        return start <= t.data_ptr() < start + self.capacity

    @property
    def used(self) -> int:
        """Bytes lent out now (each block's aligned size)."""
        with self._lock:
            self._merge_returned()
            return self._used

    def _merge_returned(self) -> None:
        """Put the blocks given back since the last call into the free list (a finalizer may run in
        any thread, even one that holds the lock: it only appends to `_returned`)."""
        while self._returned:
            offset, size = self._returned.popleft()
            self._used -= size
            i = bisect.bisect(self._free, (offset, size))
            if i < len(self._free) and offset + size == self._free[i][0]:  # joins the next free range
                size += self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and the previous one
                offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
                i -= 1
                del self._free[i]
            self._free.insert(i, (offset, size))

    def summary(self) -> dict[str, int]:
        return {"capacity": self.capacity, "used": self.used, "misses": self.misses}
