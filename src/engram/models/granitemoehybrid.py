"""GraniteMoeHybridForCausalLM (Granite 4.0-H): Mamba2 or attention, then MoE + shared MLP,
with Granite's embedding / residual / logits multipliers."""

from __future__ import annotations

import torch
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers.mlp import FusedGatedMLP, SoftmaxTopKMoE
from engram.layers.norm import RMSNorm
from engram.models.base import CausalLM, sequence_mixer
from engram.models.spec import ModelSpec


class GraniteHybridBlock(nn.Module):
    def __init__(self, spec: ModelSpec, index: int):
        super().__init__()
        cfg = spec.config
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.input_norm = RMSNorm(spec.hidden_size, eps)
        self.post_norm = RMSNorm(spec.hidden_size, eps)
        self.mixer = sequence_mixer(spec, index)
        experts = int(cfg.get("num_local_experts", 0) or 0)
        self.moe = SoftmaxTopKMoE(spec.hidden_size, cfg["intermediate_size"], experts, cfg["num_experts_per_tok"]) if experts else None
        self.shared_mlp = FusedGatedMLP(spec.hidden_size, cfg["shared_intermediate_size"])
        self.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm.add_and_norm(hidden, residual, self.residual_multiplier)
        mixed = self.mixer(h, batch)
        if self.moe is not None:
            return self.moe(mixed, residual, self.post_norm, self.residual_multiplier, self.shared_mlp)
        h, residual = self.post_norm.add_and_norm(mixed, residual, self.residual_multiplier)
        return self.shared_mlp(h), residual


class GraniteMoeHybridForCausalLM(CausalLM):
    rename_rules = [
        (r"model\.embed_tokens\.(.*)", r"embed_tokens.\1"),
        (r"model\.layers\.(\d+)\.input_layernorm\.(.*)", r"layers.\1.input_norm.\2"),
        (r"model\.layers\.(\d+)\.post_attention_layernorm\.(.*)", r"layers.\1.post_norm.\2"),
        (r"model\.layers\.(\d+)\.(?:mamba|self_attn)\.(.*)", r"layers.\1.mixer.\2"),
        (r"model\.layers\.(\d+)\.block_sparse_moe\.(?:input_linear\.weight|experts\.gate_up_proj)", r"layers.\1.moe.input_linear"),
        (r"model\.layers\.(\d+)\.block_sparse_moe\.(?:output_linear\.weight|experts\.down_proj)", r"layers.\1.moe.output_linear"),
        (r"model\.layers\.(\d+)\.block_sparse_moe\.router\.(?:layer\.)?weight", r"layers.\1.moe.router.layer.weight"),
        (r"model\.layers\.(\d+)\.shared_mlp\.(.*)", r"layers.\1.shared_mlp.\2"),
        (r"model\.norm\.(.*)", r"norm.\1"),
    ]

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        cfg = spec.config
        self.embedding_multiplier = float(cfg.get("embedding_multiplier", 1.0))
        self.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))
        self.logits_scaling = float(cfg.get("logits_scaling", 1.0))
        self.layers = nn.ModuleList(GraniteHybridBlock(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, float(cfg.get("rms_norm_eps", 1e-6)))
