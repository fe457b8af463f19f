"""Lfm2ForCausalLM (LFM2): gated short convolutions or attention with q/k norms, then a gated SiLU
MLP, pre-norm; the final norm is the checkpoint's `embedding_norm`."""

from __future__ import annotations

from torch import nn

from engram.layers.norm import RMSNorm
from engram.models.bamba import BambaBlock
from engram.models.base import CausalLM
from engram.models.spec import ConfigError, ModelSpec


class Lfm2Block(BambaBlock):
    @staticmethod
    def norm_eps(cfg: dict) -> float:
        return float(cfg.get("norm_eps", 1e-5))

    @staticmethod
    def ffn_width(cfg: dict) -> int:
        """As transformers derives it (`block_auto_adjust_ff_dim`: 2/3 of intermediate_size, scaled
        by `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`)."""
        width = int(cfg["intermediate_size"])
        if not cfg.get("block_auto_adjust_ff_dim", True):
            return width
        width = int(2 * width / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is None:
            return width
        multiple = int(cfg.get("block_multiple_of", 256))
        return multiple * ((int(multiplier * width) + multiple - 1) // multiple)


class Lfm2ForCausalLM(CausalLM):
    rename_rules = [
        (r"model\.embed_tokens\.(.*)", r"embed_tokens.\1"),
        (r"model\.layers\.(\d+)\.operator_norm\.(.*)", r"layers.\1.input_norm.\2"),
        (r"model\.layers\.(\d+)\.ffn_norm\.(.*)", r"layers.\1.post_norm.\2"),
        (r"model\.layers\.(\d+)\.self_attn\.out_proj\.(.*)", r"layers.\1.mixer.o_proj.\2"),
        (r"model\.layers\.(\d+)\.self_attn\.(q|k)_layernorm\.(.*)", r"layers.\1.mixer.\2_norm.\3"),
        (r"model\.layers\.(\d+)\.(?:self_attn|conv)\.(.*)", r"layers.\1.mixer.\2"),
        (r"model\.layers\.(\d+)\.feed_forward\.w1\.(.*)", r"layers.\1.ffn.gate_proj.\2"),
        (r"model\.layers\.(\d+)\.feed_forward\.w3\.(.*)", r"layers.\1.ffn.up_proj.\2"),
        (r"model\.layers\.(\d+)\.feed_forward\.w2\.(.*)", r"layers.\1.ffn.down_proj.\2"),
        (r"model\.embedding_norm\.(.*)", r"norm.\1"),
    ]

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        if self.tensor_parallel_size > 1:  # the short conv declares no shards yet
            raise ConfigError(f"{spec.architecture} does not run with --tensor-parallel-size > 1 yet")
        self.layers = nn.ModuleList(Lfm2Block(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, float(spec.config.get("norm_eps", 1e-5)))
