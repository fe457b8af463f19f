"""`ModelSpec`: the one source of truth for layer kinds and per-sequence state / KV shapes.

Parsed once from a checkpoint's `config.json` (Hugging Face field names). The model builder, the
state and KV pools, the memory planner and the snapshot format all derive their shapes from it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot be served safely (missing or inconsistent fields)."""


class LayerKind(str, Enum):
    MAMBA = "mamba"
    GATED_DELTANET = "gated_deltanet"
    KDA = "kda"  # Kimi Delta Attention: the gated delta rule with a decay per key channel
    SHORT_CONV = "short_conv"
    ATTENTION = "attention"
    MLP = "mlp"
    MOE = "moe"


class StateRole(str, Enum):
    """Which configured dtype a recurrent state tensor is kept in (`StateDtypes` has one per role)."""

    CONV = "conv"  # a causal conv's last inputs: the model dtype
    RECURRENT = "ssm"  # a scan's state: --mamba-ssm-dtype


@dataclass(frozen=True)
class StateTensor:
    """One per-sequence state tensor a recurrent mixer keeps: snapshot name `layers.<i>.<suffix>`."""

    suffix: str
    shape: tuple[int, ...]
    role: StateRole

    def verify_shape(self, positions: int) -> tuple[int, ...]:
        """Its buffer in a speculative verify step of `positions` fed tokens per sequence (without
        the sequence dim): a conv window [K-1 + positions, C], the old inputs then the fed ones, or
        a scan's state after each position [positions, *shape]."""
        if self.role is StateRole.CONV:
            return (self.shape[0] + positions, *self.shape[1:])
        return (positions, *self.shape)


# Every spelling of a layer type seen in HF configs, old and new. "linear_attention" is absent: it
# names the architecture's own linear mixer (Mamba2 in Granite and Nemotron-H configs written by
# transformers 5, gated DeltaNet in Qwen3-Next), so each parser says which (`_layer_kinds`).
_LAYER_KIND_ALIASES = {
    "mamba": LayerKind.MAMBA,
    "m": LayerKind.MAMBA,
    "attention": LayerKind.ATTENTION,
    "*": LayerKind.ATTENTION,
    "full_attention": LayerKind.ATTENTION,
    "mlp": LayerKind.MLP,
    "-": LayerKind.MLP,
    "moe": LayerKind.MOE,
    "e": LayerKind.MOE,
}


class GateNorm(str, Enum):
    """How a Mamba2 mixer's scan output y meets its gate z before the output projection."""

    AFTER_GATE = "after_gate"  # rms_norm(y * silu(z)): Mamba2, Granite, Bamba, Nemotron-H
    BEFORE_GATE = "before_gate"  # rms_norm(y) * silu(z): Falcon-H1 with mamba_norm_before_gate
    NONE = "none"  # y * silu(z), no norm: Falcon-H1 without mamba_rms_norm


def _conv_and_scan(conv_kernel: int, conv_dim: int, scan: str, scan_shape: tuple[int, ...]) -> tuple[StateTensor, ...]:
    """What Mamba2 and gated DeltaNet keep: a causal conv's last `conv_kernel - 1` inputs and a scan's state."""
    return (
        StateTensor("conv", (conv_kernel - 1, conv_dim), StateRole.CONV),
        StateTensor(scan, scan_shape, StateRole.RECURRENT),
    )


@dataclass(frozen=True)
class MambaSpec:
    """Shapes of one Mamba2 mixer (all Mamba2 layers of a model share them)."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    norm_eps: float
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    gate_norm: GateNorm = GateNorm.AFTER_GATE
    out_proj_bias: bool | None = None  # None: as proj_bias (Falcon-H1 has a flag of its own)

    @property
    def out_bias(self) -> bool:
        return self.proj_bias if self.out_proj_bias is None else self.out_proj_bias

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_kernel - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def state_tensors(self) -> tuple[StateTensor, ...]:
        return _conv_and_scan(self.conv_kernel, self.conv_dim, "ssm", self.ssm_state_shape)


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """Shapes of one gated DeltaNet mixer (Qwen3-Next, Qwen3.5): a causal conv over q, k and v,
    then the gated delta rule with `num_v_heads` value heads grouped over `num_k_heads` q/k heads."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float
    chunk_size: int = 64  # of the chunked prefill (fla-core's; the result does not depend on it)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    @property
    def in_proj_size(self) -> int:
        """q, k, v, the output gate z, and the write strength b and decay a of each value head."""
        return self.conv_dim + self.value_dim + 2 * self.num_v_heads

    @property
    def state_tensors(self) -> tuple[StateTensor, ...]:
        return _conv_and_scan(self.conv_kernel, self.conv_dim, "recurrent", self.recurrent_state_shape)


@dataclass(frozen=True)
class ShortConvSpec:
    """Shapes of one gated short convolution (LFM2): in_proj -> B, C, x; C * conv(B * x), a causal
    depthwise conv of `conv_kernel` taps over the hidden width, no activation. Its only state is the
    conv window."""

    hidden_size: int
    conv_kernel: int
    bias: bool

    @property
    def state_tensors(self) -> tuple[StateTensor, ...]:
        return (StateTensor("conv", (self.conv_kernel - 1, self.hidden_size), StateRole.CONV),)


@dataclass(frozen=True)
class KimiDeltaSpec:
    """Shapes of one Kimi Delta Attention mixer (Kimi-Linear): `num_heads` heads of `head_dim` for
    q, k and v alike, a causal conv over each, a decay per head and key channel from a low-rank
    projection (rank `head_dim`), and a low-rank sigmoid output gate."""

    num_heads: int
    head_dim: int
    conv_kernel: int
    norm_eps: float
    chunk_size: int = 64  # of the chunked prefill (the result does not depend on it)

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.qkv_dim

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.head_dim)

    @property
    def in_proj_size(self) -> int:
        """q, k, v, the decay's and the gate's low-rank inputs, and each head's write strength."""
        return self.conv_dim + 2 * self.head_dim + self.num_heads

    @property
    def state_tensors(self) -> tuple[StateTensor, ...]:
        return _conv_and_scan(self.conv_kernel, self.conv_dim, "recurrent", self.recurrent_state_shape)


RecurrentSpec = MambaSpec | GatedDeltaNetSpec | ShortConvSpec | KimiDeltaSpec


@dataclass(frozen=True)
class LatentAttentionSpec:
    """Multi-head latent attention (DeepSeek-V2's MLA, Kimi-Linear's without rotation): k and v of
    every head from one normed latent of `kv_lora_rank` channels, plus `qk_rope_head_dim` key
    channels shared by all heads; q direct or through a normed latent of `q_lora_rank`."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    rotary_dim: int = 0  # 0: no positional rotation (NoPE)
    rope_theta: float = 10000.0
    bias: bool = False
    # Qwen3-Next / Qwen3.5: q_proj also yields a sigmoid gate on the output, q and k are RMS-normed per head
    output_gate: bool = False
    qk_norm: bool = False
    qk_norm_zero_centered: bool = True  # (1 + w), as Qwen has it; False: a plain RMS norm (LFM2)
    norm_eps: float = 1e-6
    # Kimi-Linear: K and V expanded from a latent (head_dim is then the cache's, K's and V's widest)
    latent: LatentAttentionSpec | None = None


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    model_type: str
    hidden_size: int
    vocab_size: int
    # Each layer's mixers: one for most architectures, several run side by side (Falcon-H1:
    # Mamba2 and attention) whose state the layer keeps together.
    layer_mixers: tuple[tuple[LayerKind, ...], ...]
    mamba: MambaSpec | None
    attention: AttentionSpec | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    config: dict[str, Any] = field(repr=False, compare=False)
    config_sha256: str = ""
    gated_deltanet: GatedDeltaNetSpec | None = None
    short_conv: ShortConvSpec | None = None
    kda: KimiDeltaSpec | None = None

    def __post_init__(self) -> None:
        for i in range(self.num_layers):  # the mixers of a layer share its snapshot names `layers.<i>.*`
            names = [t.suffix for t in self.state_tensors(i)] + (["k", "v"] if LayerKind.ATTENTION in self.mixers(i) else [])
            if len(set(names)) < len(names):
                raise ConfigError(f"{self.architecture}: layer {i}'s mixers {self.layout()[i]} declare the same state twice: {names}")

    def _recurrent_mixers(self) -> dict[LayerKind, RecurrentSpec]:
        """The spec of each recurrent mixer kind this model has (one entry per kind)."""
        mixers: dict[LayerKind, RecurrentSpec] = {}
        if self.mamba is not None:
            mixers[LayerKind.MAMBA] = self.mamba
        if self.gated_deltanet is not None:
            mixers[LayerKind.GATED_DELTANET] = self.gated_deltanet
        if self.short_conv is not None:
            mixers[LayerKind.SHORT_CONV] = self.short_conv
        if self.kda is not None:
            mixers[LayerKind.KDA] = self.kda
        return mixers

    def mixers(self, layer: int) -> tuple[LayerKind, ...]:
        return self.layer_mixers[layer]

    def mixer_state_tensors(self, kind: LayerKind) -> tuple[StateTensor, ...]:
        """The per-sequence state one mixer of `kind` keeps (none for attention, MLP and MoE)."""
        mixer = self._recurrent_mixers().get(kind)
        return mixer.state_tensors if mixer is not None else ()

    def state_tensors(self, layer: int) -> tuple[StateTensor, ...]:
        """The per-sequence state layer `layer` keeps: the concatenation over the layer's mixers,
        so a layer with two mixers declares both."""
        return tuple(t for kind in self.mixers(layer) for t in self.mixer_state_tensors(kind))

    @property
    def recurrent_layers(self) -> list[int]:
        """Layers that keep per-sequence recurrent state, of whatever mixer kind."""
        return [i for i in range(self.num_layers) if self.state_tensors(i)]

    @property
    def num_layers(self) -> int:
        return len(self.layer_mixers)

    def layers_of(self, kind: LayerKind) -> list[int]:
        """Layers that have a mixer of `kind` (alone or beside others)."""
        return [i for i, mixers in enumerate(self.layer_mixers) if kind in mixers]

    @property
    def mamba_layers(self) -> list[int]:
        return self.layers_of(LayerKind.MAMBA)

    @property
    def gated_deltanet_layers(self) -> list[int]:
        return self.layers_of(LayerKind.GATED_DELTANET)

    @property
    def short_conv_layers(self) -> list[int]:
        return self.layers_of(LayerKind.SHORT_CONV)

    @property
    def kda_layers(self) -> list[int]:
        return self.layers_of(LayerKind.KDA)

    @property
    def attention_layers(self) -> list[int]:
        return self.layers_of(LayerKind.ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.recurrent_layers) and bool(self.attention_layers)

    def layout(self) -> list[str]:
        """Each layer's mixers, `+`-joined when several (`"mamba+attention"`): one-mixer layers read
        as they always have, so snapshots of those models stay compatible."""
        return ["+".join(k.value for k in mixers) for mixers in self.layer_mixers]


def _require(cfg: dict, name: str, arch: str, aliases: tuple[str, ...] = ()) -> Any:
    for key in (name, *aliases):
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    raise ConfigError(f"{arch}: config.json lacks required field '{name}'")


def _positive_int(cfg: dict, name: str, arch: str, aliases: tuple[str, ...] = ()) -> int:
    value = _require(cfg, name, arch, aliases)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{arch}: recurrent/attention dimension '{name}' must be a positive integer, got {value!r}")
    return value


def _json_float(value: Any) -> float:
    # transformers writes non-finite floats as {"__float__": "Infinity"}.
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def _time_step_limit(cfg: dict) -> tuple[float, float]:
    limit = cfg.get("time_step_limit") or cfg.get("mamba_dt_limit") or (0.0, math.inf)
    return (_json_float(limit[0]), _json_float(limit[1]))


Layers = tuple[tuple[LayerKind, ...], ...]


def _one_mixer_each(kinds: tuple[LayerKind, ...]) -> Layers:
    return tuple((kind,) for kind in kinds)


def _layer_kinds(
    raw: list[str] | str, arch: str, linear: LayerKind = LayerKind.MAMBA, own: dict[str, LayerKind] | None = None
) -> tuple[LayerKind, ...]:
    """The layer kinds of a config's list; "linear_attention" is `linear`, the architecture's mixer,
    and `own` the spellings only this architecture has (LFM2's "conv")."""
    aliases = {**_LAYER_KIND_ALIASES, "linear_attention": linear, **(own or {})}
    kinds = []
    for item in raw:
        kind = aliases.get(str(item).lower())
        if kind is None:
            raise ConfigError(f"{arch}: unknown layer type {item!r}")
        kinds.append(kind)
    return tuple(kinds)


def _mamba2_head_dim(cfg: dict, arch: str, heads_field: str, head_dim_field: str, expand_field: str) -> int:
    head_dim = cfg.get(head_dim_field)
    if head_dim == "auto":
        expand = _positive_int(cfg, expand_field, arch)
        return expand * _positive_int(cfg, "hidden_size", arch) // _positive_int(cfg, heads_field, arch)
    return _positive_int(cfg, head_dim_field, arch)


def _check_mamba_width(spec: MambaSpec, cfg: dict, arch: str, expand_field: str) -> None:
    expand = cfg.get(expand_field)
    if expand is not None and int(expand * cfg["hidden_size"]) != spec.intermediate_size:
        raise ConfigError(f"{arch}: {expand_field} * hidden_size ({int(expand * cfg['hidden_size'])}) != heads * head_dim ({spec.intermediate_size})")
    _check_mamba_groups(spec, arch)


def _check_mamba_groups(spec: MambaSpec, arch: str) -> None:
    if spec.num_heads % spec.n_groups:
        raise ConfigError(f"{arch}: mamba heads ({spec.num_heads}) not divisible by n_groups ({spec.n_groups})")


def _rope(cfg: dict, head_dim: int, partial: float) -> tuple[int, float]:
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", partial)
    return int(head_dim * partial), float(theta)


def _default_rope_only(cfg: dict, arch: str) -> None:
    rope_type = (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(f"{arch}: rope_type {rope_type!r} is not supported (only 'default')")


def _attention(cfg: dict, arch: str, scaling: float | None, rotary_dim: int, rope_theta: float, head_dim: int, bias: bool) -> AttentionSpec:
    heads = _positive_int(cfg, "num_attention_heads", arch)
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=_positive_int(cfg, "num_key_value_heads", arch) if cfg.get("num_key_value_heads") else heads,
        head_dim=head_dim,
        scaling=head_dim**-0.5 if scaling is None else scaling,
        rotary_dim=rotary_dim,
        rope_theta=rope_theta,
        bias=bias,
    )


def _parse_mamba2(cfg: dict, arch: str):
    n = _positive_int(cfg, "num_hidden_layers", arch)
    mamba = MambaSpec(
        num_heads=_positive_int(cfg, "num_heads", arch),
        head_dim=_positive_int(cfg, "head_dim", arch),
        state_size=_positive_int(cfg, "state_size", arch),
        n_groups=_positive_int(cfg, "n_groups", arch),
        conv_kernel=_positive_int(cfg, "conv_kernel", arch),
        chunk_size=int(cfg.get("chunk_size", 256)),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        time_step_limit=_time_step_limit(cfg),
    )
    _check_mamba_width(mamba, cfg, arch, "expand")
    return _one_mixer_each((LayerKind.MAMBA,) * n), mamba, None


def _mamba_fields(cfg: dict, arch: str, head_dim: int, eps: float, **extra: Any) -> MambaSpec:
    """A MambaSpec from the `mamba_*` fields Granite 4.0-H, Bamba and Falcon-H1 share."""
    return MambaSpec(
        num_heads=_positive_int(cfg, "mamba_n_heads", arch),
        head_dim=head_dim,
        state_size=_positive_int(cfg, "mamba_d_state", arch),
        n_groups=_positive_int(cfg, "mamba_n_groups", arch),
        conv_kernel=_positive_int(cfg, "mamba_d_conv", arch),
        chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        norm_eps=float(cfg.get("rms_norm_eps", eps)),
        time_step_limit=_time_step_limit(cfg),
        **extra,
    )


def _parse_granite_or_bamba(cfg: dict, arch: str):
    mt = cfg["model_type"]
    if mt == "bamba":
        n = _positive_int(cfg, "num_hidden_layers", arch)
        attn_idx = set(cfg.get("attn_layer_indices") or [])
        kinds = tuple(LayerKind.ATTENTION if i in attn_idx else LayerKind.MAMBA for i in range(n))
    else:
        raw = cfg.get("layer_types") or cfg.get("layers_block_type")
        if raw is None:
            raise ConfigError(f"{arch}: config.json lacks required field 'layer_types'")
        kinds = _layer_kinds(raw, arch)
    mamba = None
    if LayerKind.MAMBA in kinds:
        head_dim = _mamba2_head_dim(cfg, arch, "mamba_n_heads", "mamba_d_head", "mamba_expand")
        mamba = _mamba_fields(cfg, arch, head_dim, 1e-6 if mt != "bamba" else 1e-5)
        _check_mamba_width(mamba, cfg, arch, "mamba_expand")
    attention = None
    if LayerKind.ATTENTION in kinds:
        heads = _positive_int(cfg, "num_attention_heads", arch)
        head_dim = cfg.get("head_dim") or _positive_int(cfg, "hidden_size", arch) // heads
        if mt == "bamba":
            rotary_dim, theta = _rope(cfg, head_dim, 0.5)
            scaling = None
        else:
            uses_rope = cfg.get("position_embedding_type") == "rope"
            rotary_dim, theta = _rope(cfg, head_dim, 1.0) if uses_rope else (0, 10000.0)
            scaling = float(cfg.get("attention_multiplier", 1.0))
        attention = _attention(cfg, arch, scaling, rotary_dim, theta, head_dim, bool(cfg.get("attention_bias", False)))
    return _one_mixer_each(kinds), mamba, attention


def _parse_nemotron_h(cfg: dict, arch: str):
    raw = cfg.get("layers_block_type") or cfg.get("layer_types") or cfg.get("hybrid_override_pattern")
    if raw is None:
        raise ConfigError(f"{arch}: config.json lacks required field 'hybrid_override_pattern'")
    kinds = _layer_kinds(list(raw) if isinstance(raw, str) else raw, arch)
    mamba = None
    if LayerKind.MAMBA in kinds:
        mamba = MambaSpec(
            num_heads=_positive_int(cfg, "mamba_num_heads", arch),
            head_dim=_positive_int(cfg, "mamba_head_dim", arch),
            state_size=_positive_int(cfg, "ssm_state_size", arch),
            n_groups=_positive_int(cfg, "n_groups", arch, ("mamba_n_groups",)),
            conv_kernel=_positive_int(cfg, "conv_kernel", arch, ("mamba_d_conv",)),
            chunk_size=int(cfg.get("chunk_size", cfg.get("mamba_chunk_size", 128))),
            conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
            proj_bias=bool(cfg.get("use_bias", False)),  # as transformers: Nemotron-H's mamba_proj_bias is not read
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            time_step_limit=_time_step_limit(cfg),
        )
    attention = None
    if LayerKind.ATTENTION in kinds:
        heads = _positive_int(cfg, "num_attention_heads", arch)
        head_dim = cfg.get("head_dim") or _positive_int(cfg, "hidden_size", arch) // heads
        # transformers builds Nemotron-H's attention without biases, whatever attention_bias says
        attention = _attention(cfg, arch, None, 0, 10000.0, head_dim, bias=False)
    return _one_mixer_each(kinds), mamba, attention


def _parse_falcon_h1(cfg: dict, arch: str) -> tuple[Layers, MambaSpec, AttentionSpec]:
    """Every layer runs Mamba2 and attention side by side (transformers' FalconH1DecoderLayer)."""
    n = _positive_int(cfg, "num_hidden_layers", arch)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{arch}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    heads = _positive_int(cfg, "mamba_n_heads", arch)
    # transformers reads an absent mamba_d_ssm as its default (1024) and null as mamba_expand x hidden_size
    if "mamba_d_ssm" not in cfg:
        raise ConfigError(f"{arch}: config.json lacks required field 'mamba_d_ssm' (null: mamba_expand x hidden_size)")
    if cfg["mamba_d_ssm"] is not None:
        d_ssm = _positive_int(cfg, "mamba_d_ssm", arch)
    else:
        d_ssm = int(_positive_int(cfg, "mamba_expand", arch) * _positive_int(cfg, "hidden_size", arch))
    head_dim = d_ssm // heads if cfg.get("mamba_d_head", "auto") == "auto" else _positive_int(cfg, "mamba_d_head", arch)
    if heads * head_dim != d_ssm:
        raise ConfigError(f"{arch}: mamba_n_heads * mamba_d_head ({heads * head_dim}) != the Mamba width mamba_d_ssm ({d_ssm})")
    if not cfg.get("mamba_rms_norm", False):
        gate_norm = GateNorm.NONE
    else:
        gate_norm = GateNorm.BEFORE_GATE if cfg.get("mamba_norm_before_gate", True) else GateNorm.AFTER_GATE
    mamba = _mamba_fields(cfg, arch, head_dim, 1e-5, gate_norm=gate_norm, out_proj_bias=bool(cfg.get("projectors_bias", False)))
    _check_mamba_groups(mamba, arch)
    attention_heads = _positive_int(cfg, "num_attention_heads", arch)
    head_dim = cfg.get("head_dim") or _positive_int(cfg, "hidden_size", arch) // attention_heads
    _default_rope_only(cfg, arch)
    rotary_dim, theta = _rope(cfg, head_dim, 1.0)
    attention = _attention(cfg, arch, None, rotary_dim, theta, head_dim, bool(cfg.get("attention_bias", False)))
    return ((LayerKind.MAMBA, LayerKind.ATTENTION),) * n, mamba, attention


def _parse_qwen_gdn(cfg: dict, arch: str) -> tuple[Layers, GatedDeltaNetSpec | None, AttentionSpec | None]:
    """Qwen3-Next and Qwen3.5 (dense and MoE): gated DeltaNet layers and gated attention layers."""
    raw = cfg.get("layer_types")
    if raw is None:  # as transformers: every `full_attention_interval`-th layer is attention
        interval = int(cfg.get("full_attention_interval", 4))
        raw = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(_positive_int(cfg, "num_hidden_layers", arch))]
    kinds = _layer_kinds(raw, arch, linear=LayerKind.GATED_DELTANET)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    gdn = None
    if LayerKind.GATED_DELTANET in kinds:
        gdn = GatedDeltaNetSpec(
            num_k_heads=_positive_int(cfg, "linear_num_key_heads", arch),
            num_v_heads=_positive_int(cfg, "linear_num_value_heads", arch),
            head_k_dim=_positive_int(cfg, "linear_key_head_dim", arch),
            head_v_dim=_positive_int(cfg, "linear_value_head_dim", arch),
            conv_kernel=_positive_int(cfg, "linear_conv_kernel_dim", arch),
            norm_eps=eps,
        )
        if gdn.num_v_heads % gdn.num_k_heads:
            raise ConfigError(f"{arch}: linear_num_value_heads ({gdn.num_v_heads}) not divisible by linear_num_key_heads ({gdn.num_k_heads})")
    attention = None
    if LayerKind.ATTENTION in kinds:
        head_dim = _positive_int(cfg, "head_dim", arch)
        rotary_dim, theta = _rope(cfg, head_dim, float(cfg.get("partial_rotary_factor", 0.25)))
        attention = replace(
            _attention(cfg, arch, None, rotary_dim, theta, head_dim, bool(cfg.get("attention_bias", False))),
            output_gate=True,
            qk_norm=True,
            norm_eps=eps,
        )
    return _one_mixer_each(kinds), gdn, attention


def _parse_lfm2(cfg: dict, arch: str) -> tuple[Layers, ShortConvSpec | None, AttentionSpec | None]:
    """LFM2: gated short convolutions and attention with q/k norms (`layer_types`, or `full_attn_idxs`)."""
    raw = cfg.get("layer_types")
    if raw is None:
        attention_at = set(_require(cfg, "full_attn_idxs", arch))
        raw = ["full_attention" if i in attention_at else "conv" for i in range(_positive_int(cfg, "num_hidden_layers", arch))]
    kinds = _layer_kinds(raw, arch, own={"conv": LayerKind.SHORT_CONV})
    short_conv = None
    if LayerKind.SHORT_CONV in kinds:
        conv_kernel = _positive_int(cfg, "conv_L_cache", arch)
        short_conv = ShortConvSpec(_positive_int(cfg, "hidden_size", arch), conv_kernel, bool(cfg.get("conv_bias", False)))
    attention = None
    if LayerKind.ATTENTION in kinds:
        head_dim = cfg.get("head_dim") or _positive_int(cfg, "hidden_size", arch) // _positive_int(cfg, "num_attention_heads", arch)
        _default_rope_only(cfg, arch)
        rotary_dim, theta = _rope({"rope_theta": 1e6, **cfg}, head_dim, 1.0)  # transformers' default theta for LFM2
        attention = replace(
            _attention(cfg, arch, None, rotary_dim, theta, head_dim, bias=False),
            qk_norm=True,
            qk_norm_zero_centered=False,
            norm_eps=float(cfg.get("norm_eps", 1e-5)),
        )
    return _one_mixer_each(kinds), short_conv, attention


def kimi_mlp_layer_types(cfg: dict) -> list[str]:
    """Kimi-Linear's feed-forward per layer, "dense" or "sparse" (MoE): `mlp_layer_types`, else the
    first `first_k_dense_replace` layers dense (transformers' default: 1)."""
    n = int(cfg["num_hidden_layers"])
    return list(cfg.get("mlp_layer_types") or ["dense" if i < int(cfg.get("first_k_dense_replace", 1)) else "sparse" for i in range(n)])


def _kimi_layer_types(cfg: dict, arch: str, linear: dict) -> list[str]:
    """`layer_types`; else the checkpoint's 1-based `linear_attn_config` lists; else transformers'
    default (full attention at every fourth layer but the first)."""
    n = _positive_int(cfg, "num_hidden_layers", arch)
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if "full_attn_layers" in linear and "kda_layers" in linear:
        types = {i - 1: "full_attention" for i in linear["full_attn_layers"]} | {i - 1: "linear_attention" for i in linear["kda_layers"]}
        if sorted(types) != list(range(n)):
            raise ConfigError(f"{arch}: linear_attn_config's full_attn_layers and kda_layers do not name each of the {n} layers once")
        return [types[i] for i in range(n)]
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


def _refuse(cfg: dict, arch: str, field_name: str, allowed: tuple[Any, ...], why: str) -> None:
    if field_name in cfg and cfg[field_name] not in allowed:
        raise ConfigError(f"{arch}: {field_name}={cfg[field_name]!r} is not supported ({why})")


def _parse_kimi_linear(cfg: dict, arch: str) -> tuple[Layers, KimiDeltaSpec | None, AttentionSpec | None]:
    """Kimi-Linear: KDA or latent attention (no rotation), then a dense gated MLP or a MoE with
    sigmoid grouped routing and shared experts (transformers' KimiLinearForCausalLM)."""
    _refuse(cfg, arch, "hidden_act", ("silu",), "only 'silu'")
    _refuse(cfg, arch, "mla_use_nope", (True,), "transformers' Kimi-Linear attention has no rotary embedding")
    _refuse(cfg, arch, "moe_router_activation_func", ("sigmoid",), "only sigmoid routing")
    _refuse(cfg, arch, "attention_bias", (False,), "attention projections without biases only")
    _refuse(cfg, arch, "moe_layer_freq", (1,), "transformers reads a MoE in every layer past first_k_dense_replace")
    linear = cfg.get("linear_attn_config") or {}
    kinds = _layer_kinds(_kimi_layer_types(cfg, arch, linear), arch, linear=LayerKind.KDA)
    mlp_types = kimi_mlp_layer_types(cfg)
    if len(mlp_types) != len(kinds) or set(mlp_types) - {"dense", "sparse"}:
        raise ConfigError(f"{arch}: mlp_layer_types must give 'dense' or 'sparse' for each of the {len(kinds)} layers, got {mlp_types}")
    if "sparse" in mlp_types:
        experts, groups = _positive_int(cfg, "num_local_experts", arch), _positive_int(cfg, "n_group", arch)
        top_k, topk_group = _positive_int(cfg, "num_experts_per_tok", arch), _positive_int(cfg, "topk_group", arch)
        _positive_int(cfg, "moe_intermediate_size", arch)
        if "n_shared_experts" in cfg:  # transformers' default: 1
            _positive_int(cfg, "n_shared_experts", arch)
        if experts % groups or topk_group > groups or top_k > topk_group * (experts // groups):
            raise ConfigError(f"{arch}: num_experts {experts} in n_group {groups} with topk_group {topk_group} cannot give top {top_k}")
    if "dense" in mlp_types:
        _positive_int(cfg, "intermediate_size", arch)
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    kda = None
    if LayerKind.KDA in kinds:
        # the checkpoint's linear_attn_config wins over the flat fields, as in transformers
        named = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim", "short_conv_kernel_size": "linear_conv_kernel_dim"}
        fields = {**cfg, **{new: linear[old] for old, new in named.items() if old in linear}}
        kda = KimiDeltaSpec(
            num_heads=_positive_int(fields, "linear_num_heads", arch),
            head_dim=_positive_int(fields, "linear_head_dim", arch),
            conv_kernel=_positive_int(fields, "linear_conv_kernel_dim", arch),
            norm_eps=eps,
        )
    attention = None
    if LayerKind.ATTENTION in kinds:
        heads = _positive_int(cfg, "num_attention_heads", arch)
        if cfg.get("num_key_value_heads") not in (None, heads):
            raise ConfigError(
                f"{arch}: num_key_value_heads={cfg['num_key_value_heads']} is not supported (latent attention expands K and V to every head)"
            )
        latent = LatentAttentionSpec(
            q_lora_rank=_positive_int(cfg, "q_lora_rank", arch) if cfg.get("q_lora_rank") is not None else None,
            kv_lora_rank=_positive_int(cfg, "kv_lora_rank", arch),
            qk_nope_head_dim=_positive_int(cfg, "qk_nope_head_dim", arch),
            qk_rope_head_dim=_positive_int(cfg, "qk_rope_head_dim", arch),
            v_head_dim=_positive_int(cfg, "v_head_dim", arch),
        )
        head_dim = max(latent.qk_head_dim, latent.v_head_dim)
        # the latents' norms: RMSNorm's default epsilon in transformers, not rms_norm_eps
        attention = replace(_attention(cfg, arch, latent.qk_head_dim**-0.5, 0, 10000.0, head_dim, bias=False), latent=latent, norm_eps=1e-6)
    return _one_mixer_each(kinds), kda, attention


_PARSERS = {
    "mamba2": _parse_mamba2,
    "granitemoehybrid": _parse_granite_or_bamba,
    "bamba": _parse_granite_or_bamba,
    "nemotron_h": _parse_nemotron_h,
    "falcon_h1": _parse_falcon_h1,
    "qwen3_next": _parse_qwen_gdn,
    "qwen3_5": _parse_qwen_gdn,
    "qwen3_5_text": _parse_qwen_gdn,
    "qwen3_5_moe": _parse_qwen_gdn,
    "qwen3_5_moe_text": _parse_qwen_gdn,
    "lfm2": _parse_lfm2,
    "kimi_linear": _parse_kimi_linear,
}

# Older field names transformers still reads in place of the new ones (they win when present).
_LEGACY_FIELDS = {
    "lfm2": {"tie_embedding": "tie_word_embeddings", "block_ff_dim": "intermediate_size"},
    # the checkpoint's names of transformers' KimiLinearConfig attributes (its attribute_map)
    "kimi_linear": {
        "model_max_length": "max_position_embeddings",
        "moe_renormalize": "norm_topk_prob",
        "num_expert_group": "n_group",
        "num_experts": "num_local_experts",
        "num_experts_per_token": "num_experts_per_tok",
        "num_shared_experts": "n_shared_experts",
    },
}

# Multimodal checkpoints whose language model's config is nested under `text_config`.
_TEXT_CONFIG_TYPES = {"qwen3_5", "qwen3_5_moe"}

SUPPORTED_MODEL_TYPES = tuple(_PARSERS)
_TIED_BY_DEFAULT = {"mamba2", "lfm2"}  # transformers' config default for tie_word_embeddings


def _eos_ids(*sources: dict | None) -> tuple[int, ...]:
    ids: list[int] = []
    for source in sources:
        value = (source or {}).get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


def parse_model_spec(cfg: dict, generation_config: dict | None = None, config_sha256: str = "") -> ModelSpec:
    model_type = cfg.get("model_type")
    arch = (cfg.get("architectures") or [model_type])[0]
    if model_type not in _PARSERS:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    cfg = {**cfg, **{new: cfg[old] for old, new in _LEGACY_FIELDS.get(model_type, {}).items() if old in cfg}}
    text = _text_config(cfg, arch)
    layers, recurrent, attention = _PARSERS[model_type](text, arch)
    if not layers:
        raise ConfigError(f"{arch}: the model has no layers")
    return ModelSpec(
        architecture=arch,
        model_type=model_type,
        hidden_size=_positive_int(text, "hidden_size", arch),
        vocab_size=_positive_int(text, "vocab_size", arch),
        layer_mixers=layers,
        mamba=recurrent if isinstance(recurrent, MambaSpec) else None,
        attention=attention,
        # the outer config's: transformers ties by the config of the class it builds
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
        max_position_embeddings=int(text.get("max_position_embeddings") or 1 << 20),
        eos_token_ids=_eos_ids(cfg, text, generation_config),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype") or text.get("torch_dtype") or text.get("dtype"),
        config=text,
        config_sha256=config_sha256,
        gated_deltanet=recurrent if isinstance(recurrent, GatedDeltaNetSpec) else None,
        short_conv=recurrent if isinstance(recurrent, ShortConvSpec) else None,
        kda=recurrent if isinstance(recurrent, KimiDeltaSpec) else None,
    )


def _text_config(cfg: dict, arch: str) -> dict:
    """The language model's config: `text_config` for a multimodal checkpoint (its model_type
    the text model's, e.g. qwen3_5_text), else the config itself."""
    model_type = cfg["model_type"]
    if model_type not in _TEXT_CONFIG_TYPES:
        return cfg
    text = cfg.get("text_config")
    if text is None:  # a text-only config under the multimodal model_type
        return cfg
    if not isinstance(text, dict):
        raise ConfigError(f"{arch}: text_config must be an object")
    return {**text, "model_type": text.get("model_type") or f"{model_type}_text"}


def load_model_spec(model_path: str | Path) -> ModelSpec:
    """Read `config.json` (and `generation_config.json` when present) from a checkpoint folder."""
    path = Path(model_path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ConfigError(f"no config.json at {path}")
    raw = config_file.read_bytes()
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file}: invalid JSON ({e})") from e
    gen_file = config_file.parent / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    return parse_model_spec(cfg, gen, hashlib.sha256(raw).hexdigest())
