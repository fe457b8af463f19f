"""BambaForCausalLM: Mamba2 or attention (partial rotary), then a gated SiLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers.mlp import GatedMLP
from engram.layers.norm import RMSNorm
from engram.models.base import CausalLM, sequence_mixer
from engram.models.spec import ModelSpec


class BambaBlock(nn.Module):
    """`make_mixer` builds the token mixer (one of the layer's; Falcon-H1 runs two side by side);
    `norm_eps` and `ffn_width` read the config's fields (LFM2 names and derives them otherwise)."""

    def __init__(self, spec: ModelSpec, index: int):
        super().__init__()
        cfg = spec.config
        eps = self.norm_eps(cfg)
        self.input_norm = RMSNorm(spec.hidden_size, eps)
        self.post_norm = RMSNorm(spec.hidden_size, eps)
        self.mixer = self.make_mixer(spec, index)
        self.ffn = GatedMLP(spec.hidden_size, self.ffn_width(cfg), cfg.get("mlp_bias", False))

    @staticmethod
    def make_mixer(spec: ModelSpec, index: int) -> nn.Module:
        return sequence_mixer(spec, index)

    @staticmethod
    def norm_eps(cfg: dict) -> float:
        return float(cfg.get("rms_norm_eps", 1e-5))

    @staticmethod
    def ffn_width(cfg: dict) -> int:
        return int(cfg["intermediate_size"])

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm.add_and_norm(hidden, residual)
        h, residual = self.post_norm.add_and_norm(self.mixer(h, batch), residual)
        return self.ffn(h), residual


class BambaForCausalLM(CausalLM):
    rename_rules = [
        (r"model\.embed_tokens\.(.*)", r"embed_tokens.\1"),
        (r"model\.layers\.(\d+)\.input_layernorm\.(.*)", r"layers.\1.input_norm.\2"),
        (r"model\.layers\.(\d+)\.pre_ff_layernorm\.(.*)", r"layers.\1.post_norm.\2"),
        (r"model\.layers\.(\d+)\.(?:mamba|self_attn)\.(.*)", r"layers.\1.mixer.\2"),
        (r"model\.layers\.(\d+)\.feed_forward\.(.*)", r"layers.\1.ffn.\2"),
        (r"model\.final_layernorm\.(.*)", r"norm.\1"),
    ]

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.layers = nn.ModuleList(BambaBlock(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, float(spec.config.get("rms_norm_eps", 1e-5)))
