"""KimiLinearForCausalLM (Kimi-Linear): Kimi Delta Attention or latent attention without
rotation, then a dense gated MLP (the first `first_k_dense_replace` layers) or a MoE with
DeepSeek-V3 routing and shared experts; pre-norm with plain RMS norms.

Checkpoints keep Moonshot's names (transformers saves them back so): `block_sparse_moe`, experts'
w1 (gate), w3 (up) and w2 (down), the KDA's q/k/v convs apart."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers.mlp import GatedMLP, GroupedRouting, SigmoidGroupedMoE
from engram.layers.norm import RMSNorm
from engram.models.base import CausalLM, sequence_mixer
from engram.models.spec import ConfigError, ModelSpec, kimi_mlp_layer_types


def feed_forward(cfg: dict, hidden_size: int, dense: bool) -> nn.Module:
    if dense:
        return GatedMLP(hidden_size, cfg["intermediate_size"])
    width = cfg["moe_intermediate_size"]
    shared = GatedMLP(hidden_size, width * int(cfg.get("n_shared_experts", 1)))  # a positive count: checked by the spec parser
    routing = GroupedRouting.from_config(cfg, routed_scaling=2.446)  # KimiLinearConfig's default
    return SigmoidGroupedMoE(hidden_size, cfg["num_local_experts"], width, routing, F.silu, shared, gated=True)


class KimiLinearBlock(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, dense: bool):
        super().__init__()
        eps = float(spec.config.get("rms_norm_eps", 1e-5))
        self.input_norm = RMSNorm(spec.hidden_size, eps)
        self.post_norm = RMSNorm(spec.hidden_size, eps)
        self.mixer = sequence_mixer(spec, index)
        self.mlp = feed_forward(spec.config, spec.hidden_size, dense)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm.add_and_norm(hidden, residual)
        h, residual = self.post_norm.add_and_norm(self.mixer(h, batch), residual)
        return self.mlp(h), residual


class KimiLinearForCausalLM(CausalLM):
    rename_rules = [
        (r"model\.embed_tokens\.(.*)", r"embed_tokens.\1"),
        (r"model\.layers\.(\d+)\.input_layernorm\.(.*)", r"layers.\1.input_norm.\2"),
        (r"model\.layers\.(\d+)\.post_attention_layernorm\.(.*)", r"layers.\1.post_norm.\2"),
        (r"model\.layers\.(\d+)\.self_attn\.(.*)", r"layers.\1.mixer.\2"),
        (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(?P<expert>\d+)\.w2\.weight", r"layers.\1.mlp.down_proj[i]"),
        (r"model\.layers\.(\d+)\.block_sparse_moe\.(.*)", r"layers.\1.mlp.\2"),
        (r"model\.norm\.(.*)", r"norm.\1"),
    ]
    expert_halves = (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<half>w1|w3)\.weight", r"layers.\1.mlp.up_proj", "w1")

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        if self.tensor_parallel_size > 1:  # KDA and latent attention declare no shards yet
            raise ConfigError(f"{spec.architecture} does not run with --tensor-parallel-size > 1 yet")
        dense = [t == "dense" for t in kimi_mlp_layer_types(spec.config)]
        self.layers = nn.ModuleList(KimiLinearBlock(spec, i, dense[i]) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, float(spec.config.get("rms_norm_eps", 1e-5)))
