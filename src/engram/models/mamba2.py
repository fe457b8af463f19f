"""Mamba2ForCausalLM (e.g. Mamba-Codestral): pure Mamba2 blocks."""

from __future__ import annotations

import torch
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers.mamba2 import Mamba2Mixer
from engram.layers.norm import RMSNorm
from engram.models.base import CausalLM
from engram.models.spec import ModelSpec


class Mamba2Block(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, eps: float, residual_in_fp32: bool):
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, eps)
        assert spec.mamba is not None, "a Mamba2 model's spec has Mamba dimensions"
        self.mixer = Mamba2Mixer(spec.mamba, spec.hidden_size, index)
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None and self.residual_in_fp32:  # the stream is kept in float32 from the start
            residual = torch.zeros_like(hidden, dtype=torch.float32)
        h, residual = self.input_norm.add_and_norm(hidden, residual)
        return self.mixer(h, batch), residual


class Mamba2ForCausalLM(CausalLM):
    rename_rules = [
        (r"backbone\.embeddings?\.(.*)", r"embed_tokens.\1"),
        (r"backbone\.layers\.(\d+)\.norm\.(.*)", r"layers.\1.input_norm.\2"),
        (r"backbone\.layers\.(\d+)\.mixer\.(.*)", r"layers.\1.mixer.\2"),
        (r"backbone\.norm_f\.(.*)", r"norm.\1"),
    ]

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        eps = float(spec.config.get("layer_norm_epsilon", 1e-5))
        residual_in_fp32 = bool(spec.config.get("residual_in_fp32", True))
        self.layers = nn.ModuleList(Mamba2Block(spec, i, eps, residual_in_fp32) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, eps)
