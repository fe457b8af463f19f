"""NemotronHForCausalLM (Nemotron-H, Nemotron 3): each block is one of Mamba2, attention (no
positional rotation), relu^2 MLP or sigmoid-routed MoE, pre-norm with a residual."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers.mlp import GroupedRouting, PlainMLP, SigmoidGroupedMoE
from engram.layers.norm import RMSNorm
from engram.models.base import CausalLM, sequence_mixer
from engram.models.spec import LayerKind, ModelSpec
from engram.ops.moe import relu2

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu2": relu2, "silu": nn.functional.silu, "gelu": nn.functional.gelu}


class NemotronHBlock(nn.Module):
    def __init__(self, spec: ModelSpec, index: int):
        super().__init__()
        cfg = spec.config
        (kind,) = spec.mixers(index)
        self.kind = kind
        self.input_norm = RMSNorm(spec.hidden_size, float(cfg.get("layer_norm_epsilon", 1e-5)), weight_in_fp32=True)
        act = _ACTIVATIONS[cfg.get("mlp_hidden_act", "relu2")]
        if kind in (LayerKind.MAMBA, LayerKind.ATTENTION):
            self.mixer = sequence_mixer(spec, index)
        elif kind == LayerKind.MLP:
            self.mixer = PlainMLP(spec.hidden_size, cfg["intermediate_size"], act, cfg.get("mlp_bias", False))
        else:
            shared = PlainMLP(spec.hidden_size, cfg["moe_shared_expert_intermediate_size"], act, cfg.get("mlp_bias", False))
            self.mixer = SigmoidGroupedMoE(
                spec.hidden_size, cfg["n_routed_experts"], cfg["moe_intermediate_size"], GroupedRouting.from_config(cfg), act, shared
            )

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm.add_and_norm(hidden, residual)
        if self.kind in (LayerKind.MAMBA, LayerKind.ATTENTION):
            return self.mixer(h, batch), residual
        return self.mixer(h), residual


class NemotronHForCausalLM(CausalLM):
    rename_rules = [
        (r"(?:backbone|model)\.embeddings\.(.*)", r"embed_tokens.\1"),
        (r"(?:backbone|model)\.layers\.(\d+)\.norm\.(.*)", r"layers.\1.input_norm.\2"),
        (r"(?:backbone|model)\.layers\.(\d+)\.mixer\.experts\.(?P<expert>\d+)\.(up_proj|down_proj)\.weight", r"layers.\1.mixer.\3[i]"),
        (r"(?:backbone|model)\.layers\.(\d+)\.mixer\.experts\.(up_proj|down_proj)", r"layers.\1.mixer.\2"),
        (r"(?:backbone|model)\.layers\.(\d+)\.mixer\.(.*)", r"layers.\1.mixer.\2"),
        (r"(?:backbone|model)\.norm_f\.(.*)", r"norm.\1"),
    ]
    ignored_weights = (r"^mtp\.",)

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.layers = nn.ModuleList(NemotronHBlock(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, float(spec.config.get("layer_norm_epsilon", 1e-5)), weight_in_fp32=True)
