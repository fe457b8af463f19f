"""A loaded state's copy on the engine's device, made while the load is still reading, and the
host memory the load reads into.

A cold load reads a state's files in several threads; as each part has been read and verified,
its copy to the device is issued at once, so the copy overlaps the reads still in flight instead
of following them all. On CUDA the copies go on a side stream, from pinned host memory: blocks of
the `HostArena` page-locked at start-up (state/host_arena.py), or, when it has no room, memory
pinned for this load (which costs about as much as the read); with `pin_host` off, from pageable
memory (each copy then waits for its source to be staged by the driver; for measurements). The
staged state's `ready` event marks their end, and the engine's restore waits for it on the GPU
(`engine/pools.py:restore_state`). The load returns the host state as before (the WARM tier's
copy: pinned, so that a later restore from it does not wait on pageable memory); the staged one
goes to the engine with the request and is dropped once restored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from engram.state.host_arena import HostArena
from engram.state.sequence_state import SequenceState

# A state is staged only when its device copy takes at most this share of the device's free memory:
# the rest stays the engine's (a step's activations, other loads being staged).
FREE_MEMORY_SHARE = 0.25

Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def free_device_bytes(device: torch.device) -> int:
    """Bytes a new allocation on `device` can take: the driver's free memory and the blocks torch's
    caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


class DeviceStaging:
    """The device copy of one state, filled part by part by a load: `reserve` (the KV tensors),
    then `kv` and `recurrent` as parts are read, then `finish`, after the load has checked
    everything, which makes `state`. A load that fails never calls `finish`: `state` stays None.
    The engine `take`s the state (so that nothing else keeps its device memory alive). On the CPU
    the copies are plain ones (the tests' stand-in for a device)."""

    def __init__(self, device: torch.device, pin_host: bool = True, arena: HostArena | None = None, stage: bool = True):
        self.device = device
        self.pin_host = pin_host
        self.stage = stage  # False: only `host_empty` (a load that no request waits for: its WARM copy pinned all the same)
        self.arena = arena if pin_host else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.state: SequenceState | None = None
        self.copies = 0  # parts whose copy was issued
        self._kv: dict[str, torch.Tensor] = {}
        self._recurrent: dict[str, torch.Tensor] = {}

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory for a tensor the load reads (and this object then copies from): a block of
        the arena; else, on CUDA, pinned for this load unless `pin_host` is off; else pageable."""
        t = self.arena.empty(shape, dtype) if self.arena is not None else None
        if t is None:
            t = torch.empty(shape, dtype=dtype, pin_memory=self.stream is not None and self.pin_host)
        return t

    def reserve(self, kv: Shapes, recurrent_bytes: int) -> bool:
        """Allocate the device KV (`kv`: name -> its whole `[state_len, heads, dim]` shape and dtype)
        and start over; False, staging nothing, without `stage` or when the copy would not leave the
        device enough free memory (the engine then copies the host state itself)."""
        self.state, self._kv, self._recurrent = None, {}, {}
        nbytes = recurrent_bytes + sum(dtype.itemsize * math.prod(shape) for shape, dtype in kv.values())
        if not self.stage or (self.stream is not None and nbytes > FREE_MEMORY_SHARE * free_device_bytes(self.device)):
            return False
        with self._on_stream():
            self._kv = {name: torch.empty(shape, dtype=dtype, device=self.device) for name, (shape, dtype) in kv.items()}
        return True

    def kv(self, start: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy host KV rows (positions `start..`, one tensor per name, from `host_empty` or a
        resident state, never written again) to the same positions of the device KV."""
        with self._on_stream():
            for name, t in tensors.items():
                self._kv[name][start : start + t.shape[0]].copy_(t, non_blocking=True)
        self.copies += 1

    def recurrent(self, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._on_stream():
            for name, t in tensors.items():
                self._recurrent[name] = t.to(self.device, non_blocking=True)
        self.copies += 1

    def finish(self, tokens: Sequence[int], state_len: int) -> SequenceState:
        """The staged state (its copies may still be in flight: `ready`), once the load has verified the host one."""
        ready = self.stream.record_event() if self.stream is not None else None
        self.state = SequenceState(list(tokens), state_len, {**self._recurrent, **self._kv}, ready)
        self._kv, self._recurrent = {}, {}
        return self.state

    def take(self) -> SequenceState | None:
        """The staged state, once: this object holds it no longer."""
        state, self.state = self.state, None
        return state

    def _on_stream(self) -> torch.cuda.StreamContext:
        return torch.cuda.stream(self.stream)  # a no-op context for None (the CPU)
