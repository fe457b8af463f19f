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


@dataclass
class SequenceState:
    """State after consuming `tokens[:state_len]`; `tokens` may run past it (the last sampled token).

    `ready`, when set, is the CUDA event of the device-to-host copy still filling `tensors`: call
    `wait()` before reading them on the host."""

    tokens: list[int]
    state_len: int
    tensors: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None = field(default=None, repr=False, compare=False)

    def wait(self) -> SequenceState:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self

    def __post_init__(self) -> None:
        if not 0 <= self.state_len <= len(self.tokens):
            raise ValueError(f"state_len {self.state_len} outside 0..{len(self.tokens)}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def without_attention_kv(self) -> SequenceState:
        """A copy that lacks every attention layer's KV (used to show such a state is wrong)."""
        kept = {k: v for k, v in self.tensors.items() if not k.endswith((".k", ".v"))}
        return SequenceState(list(self.tokens), self.state_len, kept)


def recurrent_tensors(spec: ModelSpec, dtypes: StateDtypes) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the fixed-size state every recurrent layer declares."""
    return {
        f"layers.{i}.{t.suffix}": (t.shape, dtypes.of(t.role)) for i in spec.recurrent_layers for t in spec.state_tensors(i)
    }


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
    missing = sorted(set(expected) - set(state.tensors))
    extra = sorted(set(state.tensors) - set(expected))
    if missing:
        raise ValueError(f"state lacks tensors: {', '.join(missing)}")
    if extra:
        raise ValueError(f"state has unexpected tensors: {', '.join(extra)}")
    for name, (shape, dtype) in expected.items():
        t = state.tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != dtype:
            raise ValueError(f"tensor {name} has dtype {t.dtype}, expected {dtype}")
        if check_finite and has_non_finite(t):
            raise ValueError(f"tensor {name} holds non-finite values")
