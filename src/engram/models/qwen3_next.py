"""Qwen3NextForCausalLM (Qwen3-Next): gated DeltaNet or gated attention, then a MoE with a gated
shared expert (a dense gated MLP on `mlp_only_layers` and off `decoder_sparse_step`), pre-norm with
zero-centered RMS norms."""

from __future__ import annotations

import torch
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers.mlp import GatedMLP, SharedExpertGateMoE
from engram.layers.norm import ZeroCenteredRMSNorm
from engram.layers.parallel import Shard
from engram.models.base import CausalLM, sequence_mixer
from engram.models.spec import ModelSpec

# The language model's weights; multimodal Qwen3.5 checkpoints nest them under `language_model`.
_PREFIX = r"model\.(?:language_model\.)?"
# An expert's gate or up projection: a half of its rows in the stacked gate_up_proj.
_EXPERT_HALF = _PREFIX + r"layers\.(\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<half>gate|up)_proj\.weight"


def feed_forward(cfg: dict, hidden_size: int, index: int, norm_topk_prob: bool) -> nn.Module:
    """Layer `index`'s MLP: the MoE where the config has experts for it, else a dense gated MLP."""
    experts = int(cfg.get("num_experts") or 0)
    if experts and (index + 1) % int(cfg.get("decoder_sparse_step") or 1) == 0 and index not in (cfg.get("mlp_only_layers") or []):
        return SharedExpertGateMoE(
            hidden_size, cfg["moe_intermediate_size"], experts, cfg["num_experts_per_tok"], norm_topk_prob, cfg["shared_expert_intermediate_size"]
        )
    return GatedMLP(hidden_size, cfg["intermediate_size"])


class QwenHybridBlock(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, norm_topk_prob: bool):
        super().__init__()
        eps = float(spec.config.get("rms_norm_eps", 1e-6))
        self.input_norm = ZeroCenteredRMSNorm(spec.hidden_size, eps)
        self.post_norm = ZeroCenteredRMSNorm(spec.hidden_size, eps)
        self.mixer = sequence_mixer(spec, index)
        self.mlp = feed_forward(spec.config, spec.hidden_size, index, norm_topk_prob)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm.add_and_norm(hidden, residual)
        h, residual = self.post_norm.add_and_norm(self.mixer(h, batch), residual)
        return self.mlp(h), residual


class Qwen3NextForCausalLM(CausalLM):
    rename_rules = [
        (_PREFIX + r"embed_tokens\.(.*)", r"embed_tokens.\1"),
        (_PREFIX + r"layers\.(\d+)\.input_layernorm\.(.*)", r"layers.\1.input_norm.\2"),
        (_PREFIX + r"layers\.(\d+)\.post_attention_layernorm\.(.*)", r"layers.\1.post_norm.\2"),
        (_PREFIX + r"layers\.(\d+)\.(?:linear_attn|self_attn)\.(.*)", r"layers.\1.mixer.\2"),
        (_PREFIX + r"layers\.(\d+)\.mlp\.experts\.(?P<expert>\d+)\.down_proj\.weight", r"layers.\1.mlp.experts.down_proj[i]"),
        (_PREFIX + r"layers\.(\d+)\.mlp\.(.*)", r"layers.\1.mlp.\2"),
        (_PREFIX + r"norm\.(.*)", r"norm.\1"),
    ]
    ignored_weights: tuple[str, ...] = (r"^mtp\.",)
    expert_halves = (_EXPERT_HALF, r"layers.\1.mlp.experts.gate_up_proj", "gate")

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        norm_topk_prob = self.renormalizes_topk(spec.config)
        self.layers = nn.ModuleList(QwenHybridBlock(spec, i, norm_topk_prob) for i in range(spec.num_layers))
        self.norm = ZeroCenteredRMSNorm(spec.hidden_size, float(spec.config.get("rms_norm_eps", 1e-6)))

    @staticmethod
    def renormalizes_topk(cfg: dict) -> bool:
        return bool(cfg.get("norm_topk_prob", True))

    def weight_shard(self, name: str) -> Shard | None:
        half = self.expert_half(name) if self.tensor_parallel_size > 1 else None
        if half is None:
            return super().weight_shard(name)
        stacked, _, second = half
        moe = self.get_submodule(stacked.removesuffix(".experts.gate_up_proj"))
        assert isinstance(moe, SharedExpertGateMoE)
        return moe.tp_shards()[("experts.gate_proj", "experts.up_proj")[second]]
