"""The captured model state of one sequence: what a snapshot stores and a restore loads.

Tensor names follow the snapshot format (DESIGN.md): `layers.<i>.<suffix>` for each state tensor
a recurrent layer's mixer declares (`ModelSpec.state_tensors`; Mamba2: `conv`, `ssm`) and
`layers.<i>.k`, `layers.<i>.v` (`[state_len, kv_heads, head_dim]`) for attention layers. `expected_tensors` is the one place that derives those names and shapes from a
`ModelSpec`; the engine's pools and the snapshot verifier both check against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engram.models.spec import ModelSpec, StateRole


@dataclass(frozen=True)
class StateDtypes:
    conv: torch.dtype
    ssm: torch.dtype
    kv: torch.dtype

    def of(self, role: StateRole) -> torch.dtype:
        return self.conv if role is StateRole.CONV else self.ssm


def is_kv_name(name: str) -> bool:
    """Whether a state tensor name is an attention layer's KV (`layers.<i>.k` / `.v`)."""
    return name.endswith((".k", ".v"))


@dataclass(frozen=True)
class KVSegment:
    """The attention KV of positions `start..end-1`: every attention layer's `layers.<i>.k/v`,
    `[end - start, kv_heads, head_dim]`. Host segments are immutable once captured, so states of
    several turns (and branches) can hold the same one."""

    start: int
    end: int
    tensors: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        for name, t in self.tensors.items():
            if t.shape[0] != self.end - self.start:
                raise ValueError(f"KV segment {self.start}..{self.end}: tensor {name} has {t.shape[0]} rows")

    def clip(self, start: int, end: int) -> KVSegment:
        """Positions `start..end-1` of this segment (views, no copy)."""
        a, b = max(start, self.start), min(end, self.end)
        return KVSegment(a, b, {name: t[a - self.start : b - self.start] for name, t in self.tensors.items()})


@dataclass
class SequenceState:
    """State after consuming `tokens[:state_len]`; `tokens` may run past it (the last sampled token).

    The attention KV is either in `tensors` beside the recurrent tensors (one `[state_len, ...]`
    tensor per name), or, when `kv_segments` is not empty, in those segments, which cover
    `0..state_len` in order (`tensors` then holds the recurrent tensors only). A turn's capture
    is segmented: it shares the host segments of the state it resumed from and adds the new
    positions' KV. Read the KV through `kv_rows` / `kv_pieces`, which serve both layouts.

    `ready`, when set, is the CUDA event of the device-to-host copy still filling `tensors`: call
    `wait()` before reading them on the host."""

    tokens: list[int]
    state_len: int
    tensors: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None = field(default=None, repr=False, compare=False)
    kv_segments: tuple[KVSegment, ...] = ()

    def wait(self) -> SequenceState:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self

    def __post_init__(self) -> None:
        if not 0 <= self.state_len <= len(self.tokens):
            raise ValueError(f"state_len {self.state_len} outside 0..{len(self.tokens)}")
        if self.kv_segments:
            bounds = [(s.start, s.end) for s in self.kv_segments]
            if [a for a, _ in bounds] != [0, *(b for _, b in bounds[:-1])] or bounds[-1][1] != self.state_len:
                raise ValueError(f"KV segments {bounds} do not cover 0..{self.state_len} in order")
            if any(is_kv_name(name) for name in self.tensors):
                raise ValueError("a state with KV segments holds its KV in them, not in tensors")

    @property
    def kv_names(self) -> list[str]:
        if self.kv_segments:
            return list(self.kv_segments[0].tensors)
        return [name for name in self.tensors if is_kv_name(name)]

    @property
    def recurrent(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in self.tensors.items() if not is_kv_name(name)}

    def kv_pieces(self, start: int = 0, end: int | None = None) -> list[KVSegment]:
        """The KV of positions `start..end-1` (default: to `state_len`) as segments of views."""
        end = self.state_len if end is None else end
        if not self.kv_segments:
            whole = KVSegment(0, self.state_len, {name: self.tensors[name] for name in self.kv_names})
            return [whole.clip(start, end)] if start < end else []
        return [s.clip(start, end) for s in self.kv_segments if s.start < end and s.end > start]

    def kv_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """One KV tensor's positions `start..end-1`: a view within one segment, else joined."""
        if not self.kv_segments:
            return self.tensors[name][start:end]
        parts = [s.tensors[name] for s in self.kv_pieces(start, end)] or [self.kv_segments[0].tensors[name][:0]]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def flat_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name, each KV one `[state_len, ...]` tensor (joined: a host copy for a
        segmented state; for the formats that store a whole history in one file)."""
        if not self.kv_segments:
            return self.tensors
        return {**self.tensors, **{name: self.kv_rows(name, 0, self.state_len) for name in self.kv_names}}

    def all_tensors(self) -> list[torch.Tensor]:
        """Every tensor the state holds (each KV segment's too), none joined."""
        return [*self.tensors.values(), *(t for s in self.kv_segments for t in s.tensors.values())]

    @property
    def nbytes(self) -> int:
        """Bytes of the state's own view of its tensors (shared segments counted in full)."""
        return sum(t.numel() * t.element_size() for t in self.all_tensors())

    def storages(self) -> dict[int, int]:
        """Each distinct memory block the state's tensors live in (its address -> its size): the
        bytes it keeps alive, shared segments included, each block once."""
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.all_tensors()}

    def without_attention_kv(self) -> SequenceState:
        """A copy that lacks every attention layer's KV (used to show such a state is wrong)."""
        return SequenceState(list(self.tokens), self.state_len, self.recurrent)


def recurrent_tensors(spec: ModelSpec, dtypes: StateDtypes) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the fixed-size state every recurrent layer declares."""
    return {f"layers.{i}.{t.suffix}": (t.shape, dtypes.of(t.role)) for i in spec.recurrent_layers for t in spec.state_tensors(i)}


def expected_tensors(spec: ModelSpec, dtypes: StateDtypes, state_len: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor a complete state of `spec` holds."""
    out = recurrent_tensors(spec, dtypes)
    if spec.attention is not None:
        kv_shape = (state_len, spec.attention.num_kv_heads, spec.attention.head_dim)
        for i in spec.attention_layers:
            out[f"layers.{i}.k"] = (kv_shape, dtypes.kv)
            out[f"layers.{i}.v"] = (kv_shape, dtypes.kv)
    return out


# A float is infinite or NaN exactly when its exponent bits are all set: testing them as integers
# is many times faster on a CPU than torch.isfinite, which has no fast path for bfloat16.
_EXPONENT_BITS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00), torch.float32: (torch.int32, 0x7F800000)}


def has_non_finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds an infinite or NaN value (False for integer tensors)."""
    if not t.is_floating_point() or not t.numel():
        return False
    if t.dtype not in _EXPONENT_BITS or not t.is_contiguous():
        return not bool(torch.isfinite(t).all())
    as_int, mask = _EXPONENT_BITS[t.dtype]
    bits = torch.tensor(mask, dtype=as_int).item()  # the mask as this width's signed value
    return bool((t.view(as_int) & bits).eq(bits).any())


def check_state(spec: ModelSpec, dtypes: StateDtypes, state: SequenceState, check_finite: bool = True) -> None:
    """Raise ValueError naming the first missing, extra, misshapen, mistyped or non-finite tensor.

    The finiteness scan reads every byte (a second or so for a long history's KV on a CPU); the
    structural checks alone are cheap enough for every restore."""
    expected = expected_tensors(spec, dtypes, state.state_len)
    held = set(state.tensors) | set(state.kv_names)
    missing = sorted(set(expected) - held)
    extra = sorted(held - set(expected))
    if missing:
        raise ValueError(f"state lacks tensors: {', '.join(missing)}")
    if extra:
        raise ValueError(f"state has unexpected tensors: {', '.join(extra)}")
    for segment in state.kv_segments:
        if set(segment.tensors) != set(state.kv_names):
            raise ValueError(f"KV segment {segment.start}..{segment.end} holds {sorted(segment.tensors)}, expected {sorted(state.kv_names)}")
    for name, (shape, dtype) in expected.items():
        if name in state.tensors:
            parts = [(name, state.tensors[name], shape)]
        else:  # segmented KV: each segment's rows
            parts = [(f"{name}[{s.start}:{s.end}]", s.tensors[name], (s.end - s.start, *shape[1:])) for s in state.kv_segments]
        for label, t, want in parts:
            if tuple(t.shape) != want:
                raise ValueError(f"tensor {label} has shape {tuple(t.shape)}, expected {want}")
            if t.dtype != dtype:
                raise ValueError(f"tensor {label} has dtype {t.dtype}, expected {dtype}")
            if check_finite and has_non_finite(t):
                raise ValueError(f"tensor {label} holds non-finite values")
