"""Per-sequence model memory: recurrent state by slot (`StatePool`) and paged attention KV (`KVPool`)."""

from __future__ import annotations

import torch

from engram.models.spec import ModelSpec
from engram.ops.attention import token_slots
from engram.state.sequence_state import KVSegment, SequenceState, StateDtypes, is_kv_name, recurrent_tensors


class PendingCopies:
    """Which state slots a device-to-host copy may still be reading (a capture copies the recurrent
    state from the slot's views; the KV it gathers on the compute stream into fresh tensors first,
    so whatever writes the pages later is ordered after that read already).

    An entry is handed out again only after the compute stream waits for that copy (a wait on
    the GPU, not on the host)."""

    def __init__(self) -> None:
        self._events: dict[int, torch.cuda.Event] = {}

    def mark(self, entries: list[int], event: torch.cuda.Event) -> None:
        for entry in entries:
            self._events[entry] = event

    def settle(self, entries: list[int]) -> None:
        for entry in entries:
            event = self._events.pop(entry, None)
            if event is not None and not event.query():
                torch.cuda.current_stream().wait_event(event)


class HostCopier:
    """Copies captured state to host memory. On CUDA the copies go to page-locked memory on a side
    stream, so the engine loop does not wait for them; the returned event marks their end."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.bytes_copied = 0  # every copy's bytes, device to host (CPU: the clones)

    def copy(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
        self.bytes_copied += sum(t.numel() * t.element_size() for t in tensors.values())
        if self.stream is None:
            return {name: t.clone() for name, t in tensors.items()}, None
        self.stream.wait_stream(torch.cuda.current_stream())
        out = {}
        with torch.cuda.stream(self.stream):
            for name, t in tensors.items():
                out[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                out[name].copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # gathered KV temporaries live until the copy is done
        return out, self.stream.record_event()


class StatePool:
    """Every recurrent layer's declared state tensors (`ModelSpec.state_tensors`) for `num_slots`
    sequences, keyed by snapshot name.

    A slot is zeroed when handed out, which is exactly "no previous tokens" for both a
    convolution (zero padding) and a scan (zero initial state)."""

    def __init__(self, spec: ModelSpec, num_slots: int, dtypes: StateDtypes, device: torch.device):
        self.num_slots = num_slots
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.zeros(num_slots, *shape, dtype=dtype, device=device) for name, (shape, dtype) in recurrent_tensors(spec, dtypes).items()
        }
        self._free = list(range(num_slots - 1, -1, -1))
        self.pending = PendingCopies()

    def of(self, layer: int, suffix: str) -> torch.Tensor:
        """Layer `layer`'s `suffix` state for all slots: [num_slots, *shape]."""
        return self.tensors[f"layers.{layer}.{suffix}"]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        slot = self._free.pop()
        self.pending.settle([slot])
        for t in self.tensors.values():
            t[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        return {name: t[slot] for name, t in self.tensors.items()}

    def write(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in self.tensors.items():
            t[slot].copy_(tensors[name])


class KVPool:
    """Attention KV of every attention layer in pages of `block_size` tokens."""

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        if spec.attention is not None:
            shape = (num_blocks * block_size, spec.attention.num_kv_heads, spec.attention.head_dim)
            for i in spec.attention_layers:
                self.k[i] = torch.zeros(shape, dtype=dtype, device=device)
                self.v[i] = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def needs_pages(self) -> bool:
        return bool(self.k)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) if self.needs_pages else 0

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: {n} pages asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def _slots(self, blocks: list[int], length: int) -> torch.Tensor:
        table = torch.tensor(blocks, dtype=torch.long, device=next(iter(self.k.values())).device)
        return token_slots(table, length, self.block_size)

    def gather(self, blocks: list[int], length: int, start: int = 0) -> dict[str, torch.Tensor]:
        """The KV of positions start..length-1 (fresh tensors, gathered from the pages)."""
        if not self.k:
            return {}
        slots = self._slots(blocks, length)[start:]
        out = {}
        for i in self.k:
            out[f"layers.{i}.k"] = self.k[i][slots]
            out[f"layers.{i}.v"] = self.v[i][slots]
        return out

    def write(self, blocks: list[int], length: int, segments: list[KVSegment]) -> None:
        """Put the KV of positions 0..length-1, held as `segments`, into the pages."""
        if not self.k:
            return
        slots = self._slots(blocks, length)
        for segment in segments:
            rows, tensors = slots[segment.start : segment.end], segment.tensors
            for i in self.k:
                self.k[i][rows] = tensors[f"layers.{i}.k"].to(self.k[i].device)
                self.v[i][rows] = tensors[f"layers.{i}.v"].to(self.v[i].device)


def capture_state(
    state_pool: StatePool,
    kv_pool: KVPool,
    copier: HostCopier,
    slot: int,
    blocks: list[int],
    tokens: list[int],
    state_len: int,
    base: SequenceState | None = None,
    recurrent: dict[str, torch.Tensor] | None = None,
) -> SequenceState:
    """A host copy of a sequence's state; on CUDA still in flight (`SequenceState.ready`).

    `base`: a host state whose KV the pages hold unchanged for its first `base.state_len`
    positions (the state the sequence was restored from or adopted with). Only the KV past it is
    copied from the device; the result shares the base's host segments for the rest.
    `recurrent`: the recurrent tensors, copied already (a prompt's state, taken when its prefill
    ended); then only KV is copied now."""
    shared = base.kv_pieces(0, min(base.state_len, state_len)) if base is not None and kv_pool.needs_pages else []
    start = shared[-1].end if shared else 0
    copied, ready = copier.copy({**(state_pool.views(slot) if recurrent is None else {}), **kv_pool.gather(blocks, state_len, start)})
    if ready is not None and recurrent is None:
        state_pool.pending.mark([slot], ready)
    copied = {**(recurrent or {}), **copied}
    if not shared:
        return SequenceState(list(tokens), state_len, copied, ready)
    recurrent = {name: t for name, t in copied.items() if not is_kv_name(name)}
    tail = [KVSegment(start, state_len, {name: t for name, t in copied.items() if is_kv_name(name)})] if start < state_len else []
    return SequenceState(list(tokens), state_len, recurrent, ready, kv_segments=(*shared, *tail))


def restore_state(state_pool: StatePool, kv_pool: KVPool, slot: int, blocks: list[int], state: SequenceState) -> None:
    """Write a state into a slot and its pages: from host memory, or from a copy on the device (a
    staged load, whose tensors another stream made)."""
    if state.ready is not None:  # a copy still in flight (a capture, a staged load): order the restore after it, on the GPU
        torch.cuda.current_stream().wait_event(state.ready)
    state_pool.write(slot, state.tensors)
    kv_pool.write(blocks, state.state_len, state.kv_pieces())
    for t in state.all_tensors():
        if t.is_cuda:  # made on another stream: not reused before this stream's copies from it are done
            t.record_stream(torch.cuda.current_stream())
