"""FalconH1ForCausalLM (Falcon-H1): every layer runs Mamba2 and attention side by side on the same
normalized input and sums them, then a gated SiLU MLP.

transformers scales many activations (`FalconH1DecoderLayer`, `FalconH1Mixer`, `FalconH1MLP`,
`FalconH1Attention`): each multiplier there sits before or after a linear projection, so it is
folded into that projection's weights once they are loaded (`after_load`) and the forward pass
is a plain hybrid block. The embedding and LM head multipliers stay scalars of `CausalLM` (the
two may share one tied matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers.attention import Attention
from engram.layers.linear import Linear
from engram.layers.mamba2 import Mamba2Mixer
from engram.layers.norm import RMSNorm
from engram.models.bamba import BambaBlock, BambaForCausalLM
from engram.models.base import CausalLM
from engram.models.spec import ConfigError, LayerKind, MambaSpec, ModelSpec


def _floats(cfg: dict, name: str, count: int) -> tuple[float, ...]:
    values = cfg.get(name) or [1.0] * count
    if not isinstance(values, list) or len(values) != count:
        raise ConfigError(f"FalconH1ForCausalLM: {name} must be a list of {count} numbers, got {values!r}")
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class FalconH1Multipliers:
    """transformers' names and defaults (FalconH1Config)."""

    embedding: float
    lm_head: float
    attention_in: float
    attention_out: float
    key: float
    ssm_in: float
    ssm_out: float
    ssm: tuple[float, ...]  # z, x, B, C, dt: the parts of the Mamba in_proj's output (the "mup vector")
    mlp: tuple[float, ...]  # gate_proj's output (before the activation), down_proj's output

    @classmethod
    def of(cls, cfg: dict) -> FalconH1Multipliers:
        def scalar(name: str) -> float:
            value = cfg.get(name)
            return 1.0 if value is None else float(value)

        return cls(
            embedding=scalar("embedding_multiplier"),
            lm_head=scalar("lm_head_multiplier"),
            attention_in=scalar("attention_in_multiplier"),
            attention_out=scalar("attention_out_multiplier"),
            key=scalar("key_multiplier"),
            ssm_in=scalar("ssm_in_multiplier"),
            ssm_out=scalar("ssm_out_multiplier"),
            ssm=_floats(cfg, "ssm_multipliers", 5),
            mlp=_floats(cfg, "mlp_multipliers", 2),
        )

    def in_proj_rows(self, m: MambaSpec) -> torch.Tensor:
        """One factor per output row of the Mamba in_proj ([z | x | B | C | dt])."""
        group_states = m.n_groups * m.state_size
        sizes = (m.intermediate_size, m.intermediate_size, group_states, group_states, m.num_heads)
        return torch.cat([torch.full((size,), factor) for size, factor in zip(sizes, self.ssm)])


@torch.no_grad()
def _fold(linear: Linear, out_scale: torch.Tensor | float, in_scale: float = 1.0) -> None:
    """Make `linear(x)` compute `linear(x * in_scale) * out_scale` (one factor per output row, or
    one for all), in float32 before rounding to the weights' dtype."""
    rows = torch.as_tensor(out_scale, dtype=torch.float32, device=linear.weight.device).expand(linear.weight.shape[0])
    linear.weight.copy_(linear.weight.float() * (rows * in_scale)[:, None])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias.float() * rows)


class ParallelMixer(nn.Module):
    """Mamba2 and attention on the same input, their outputs summed (transformers scales each on
    the way in and out; those multipliers are folded into their projections by `fold`)."""

    def __init__(self, spec: ModelSpec, index: int):
        super().__init__()
        assert spec.mixers(index) == (LayerKind.MAMBA, LayerKind.ATTENTION) and spec.mamba and spec.attention
        self.mamba = Mamba2Mixer(spec.mamba, spec.hidden_size, index)
        self.attention = Attention(spec.attention, spec.hidden_size, index)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.mamba(hidden, batch) + self.attention(hidden, batch)

    def fold(self, m: FalconH1Multipliers) -> None:
        _fold(self.mamba.in_proj, m.in_proj_rows(self.mamba.spec), m.ssm_in)
        _fold(self.mamba.out_proj, m.ssm_out)
        q, kv, _ = self.attention.qkv_sizes
        key_rows = torch.ones(sum(self.attention.qkv_sizes))
        key_rows[q : q + kv] = m.key
        _fold(self.attention.qkv_proj, key_rows, m.attention_in)
        _fold(self.attention.o_proj, m.attention_out)


class FalconH1Block(BambaBlock):
    """Bamba's block (norm, mixer, norm, gated SiLU MLP) around the two mixers."""

    @staticmethod
    def make_mixer(spec: ModelSpec, index: int) -> nn.Module:
        return ParallelMixer(spec, index)

    def fold(self, m: FalconH1Multipliers) -> None:
        assert isinstance(self.mixer, ParallelMixer)
        self.mixer.fold(m)
        _fold(self.ffn.gate_proj, m.mlp[0])
        _fold(self.ffn.down_proj, m.mlp[1])


class FalconH1ForCausalLM(CausalLM):
    # Bamba's tensor names (transformers derives Falcon-H1 from it), each mixer in a place of its own;
    # the first rule that matches a name wins
    rename_rules = [
        (r"model\.layers\.(\d+)\.mamba\.(.*)", r"layers.\1.mixer.mamba.\2"),
        (r"model\.layers\.(\d+)\.self_attn\.(.*)", r"layers.\1.mixer.attention.\2"),
        *BambaForCausalLM.rename_rules,
    ]

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        if self.tensor_parallel_size > 1:  # the folds below index the whole projections' rows
            raise ConfigError("FalconH1ForCausalLM does not run with --tensor-parallel-size > 1 yet")
        self.multipliers = FalconH1Multipliers.of(spec.config)
        if self.multipliers.lm_head == 0.0:
            raise ConfigError("FalconH1ForCausalLM: lm_head_multiplier must not be 0")
        self.embedding_multiplier = self.multipliers.embedding
        self.logits_scaling = 1.0 / self.multipliers.lm_head
        self.layers = nn.ModuleList(FalconH1Block(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, float(spec.config.get("rms_norm_eps", 1e-5)))

    def after_load(self) -> None:
        for block in self.layers:
            assert isinstance(block, FalconH1Block)
            block.fold(self.multipliers)
