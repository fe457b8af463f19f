"""Tiny random checkpoints for tests, written with transformers `save_pretrained`.

Shapes are deliberately odd (GQA, n_groups > 1, partial rotary, vocab larger than the tokenizer)
and mamba chunks are small (8), so prompts of 20-60 tokens span several chunks. Weights are
re-drawn by `randomize_decisively` so that greedy decoding is not decided by numerical noise.
`train_demo_smoke`: the demo model's training script, run for a few steps on a few files.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from engram.models.byte_tokenizer import BOS, EOS, PAD, build_byte_tokenizer
from engram.models.embedded import randomize_decisively

_MAMBA = dict(n_groups=2, state_size=12, conv_kernel=4, chunk_size=8)
_MAMBA_PREFIXED = dict(
    mamba_n_groups=_MAMBA["n_groups"], mamba_d_state=_MAMBA["state_size"], mamba_d_conv=_MAMBA["conv_kernel"], mamba_chunk_size=_MAMBA["chunk_size"]
)  # Granite's and Falcon-H1's names
_GRANITE: dict[str, Any] = dict(
    vocab_size=272,
    hidden_size=48,
    num_hidden_layers=4,
    layer_types=["mamba", "attention", "mamba", "attention"],
    num_attention_heads=6,
    num_key_value_heads=2,
    intermediate_size=40,
    shared_intermediate_size=56,
    num_local_experts=4,
    num_experts_per_tok=2,
    # A large embedding_multiplier with tied embeddings makes the model echo its input token.
    embedding_multiplier=2.0,
    residual_multiplier=1.5,
    attention_multiplier=0.25,
    logits_scaling=0.5,
    mamba_n_heads=4,
    mamba_d_head=24,
    **_MAMBA_PREFIXED,
    tie_word_embeddings=True,
)

# Mamba2 beside attention in every layer. Mamba's width (mamba_d_ssm 72) is not expand x hidden;
# every multiplier differs from 1, and each scales a different part of a projection's output.
_FALCON_H1: dict[str, Any] = dict(
    vocab_size=276,
    hidden_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=56,
    mamba_d_ssm=72,
    mamba_n_heads=6,
    mamba_d_head=12,
    **_MAMBA_PREFIXED,
    mamba_rms_norm=True,
    mamba_norm_before_gate=True,
    embedding_multiplier=1.7,
    lm_head_multiplier=0.6,
    attention_in_multiplier=0.8,
    attention_out_multiplier=1.3,
    key_multiplier=0.55,
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.7,
    ssm_multipliers=[0.9, 1.3, 0.6, 1.4, 0.8],
    mlp_multipliers=[0.75, 1.25],
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    tie_word_embeddings=False,
)

_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba2": (
        "Mamba2Config",
        dict(vocab_size=270, hidden_size=48, num_hidden_layers=3, num_heads=6, head_dim=16, expand=2, tie_word_embeddings=False, **_MAMBA),
    ),
    "mamba2_tied": (
        "Mamba2Config",
        dict(vocab_size=270, hidden_size=48, num_hidden_layers=3, num_heads=6, head_dim=16, expand=2, tie_word_embeddings=True, **_MAMBA),
    ),
    "granite": ("GraniteMoeHybridConfig", _GRANITE),
    "granite_rope": ("GraniteMoeHybridConfig", dict(_GRANITE, position_embedding_type="rope")),
    "nemotron": (
        "NemotronHConfig",
        dict(
            vocab_size=280,
            hidden_size=48,
            hybrid_override_pattern="M*M-E*",
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            intermediate_size=64,
            mamba_num_heads=6,
            mamba_head_dim=16,
            expand=2,
            n_groups=2,
            ssm_state_size=12,
            conv_kernel=4,
            chunk_size=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=40,
            routed_scaling_factor=2.5,
            n_group=1,
            topk_group=1,
            tie_word_embeddings=False,
        ),
    ),
    "bamba": (
        "BambaConfig",
        dict(
            vocab_size=264,
            hidden_size=48,
            num_hidden_layers=4,
            attn_layer_indices=[1, 3],
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            mamba_n_heads=6,
            mamba_d_head=16,
            mamba_expand=2,
            mamba_n_groups=2,
            mamba_d_state=12,
            mamba_d_conv=4,
            mamba_chunk_size=8,
            tie_word_embeddings=False,
        ),
    ),
    "falcon_h1": ("FalconH1Config", _FALCON_H1),
    # tied, one KV head, no norm in the Mamba mixer (its output is y * silu(z))
    "falcon_h1_tied": ("FalconH1Config", dict(_FALCON_H1, tie_word_embeddings=True, num_key_value_heads=1, mamba_rms_norm=False)),
}

# Gated DeltaNet hybrids: value heads grouped over q/k heads (and not), GQA, MQA and MHA attention,
# MoE with top-k > 1 (renormalized or not) beside dense MLP layers, tied and untied embeddings.
_L, _F = "linear_attention", "full_attention"
_CONFIGS.update(
    {
        "qwen3_next": (
            "Qwen3NextConfig",
            dict(
                vocab_size=276,
                hidden_size=48,
                num_hidden_layers=4,
                layer_types=[_L, _F, _L, _F],
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=12,
                linear_value_head_dim=8,
                linear_conv_kernel_dim=4,
                intermediate_size=40,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=24,
                shared_expert_intermediate_size=32,
                mlp_only_layers=[2],
                norm_topk_prob=False,
                tie_word_embeddings=False,
            ),
        ),
        "qwen3_5": (
            "Qwen3_5TextConfig",
            dict(
                vocab_size=268,
                hidden_size=48,
                num_hidden_layers=4,
                full_attention_interval=2,
                num_attention_heads=6,
                num_key_value_heads=1,
                head_dim=8,
                linear_num_key_heads=3,
                linear_num_value_heads=3,
                linear_key_head_dim=8,
                linear_value_head_dim=12,
                linear_conv_kernel_dim=3,
                intermediate_size=64,
                tie_word_embeddings=True,
            ),
        ),
        # the multimodal checkpoint (Qwen3_5MoeForConditionalGeneration: text_config, a vision tower)
        "qwen3_5_moe": (
            "Qwen3_5MoeConfig",
            dict(
                text_config=dict(
                    vocab_size=272,
                    hidden_size=64,
                    num_hidden_layers=4,
                    layer_types=[_L, _L, _F, _L],
                    num_attention_heads=4,
                    num_key_value_heads=4,
                    head_dim=16,
                    linear_num_key_heads=2,
                    linear_num_value_heads=6,
                    linear_key_head_dim=8,
                    linear_value_head_dim=8,
                    num_experts=6,
                    num_experts_per_tok=3,
                    moe_intermediate_size=16,
                    shared_expert_intermediate_size=24,
                ),
                vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64),
                tie_word_embeddings=False,
            ),
        ),
    }
)
# LFM2: gated short convolutions and attention with q/k norms (GQA); the MLP width derived from
# intermediate_size (2/3 of it, rounded up to block_multiple_of).
_CONFIGS["lfm2"] = (
    "Lfm2Config",
    dict(
        vocab_size=270,
        hidden_size=48,
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "conv"],
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
        intermediate_size=64,
        block_multiple_of=8,
        tie_word_embeddings=True,
    ),
)
# Kimi-Linear: KDA with a decay per key channel and latent attention (v_head_dim other than
# qk_head_dim, q direct or through its own latent), a dense first layer then MoE with top-k > 1
# within the best of several groups, random correction biases, two shared experts.
_KIMI: dict[str, Any] = dict(
    vocab_size=274,
    hidden_size=48,
    intermediate_size=40,
    moe_intermediate_size=24,
    num_hidden_layers=4,
    layer_types=[_L, _F, _L, _L],
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=20,
    q_lora_rank=None,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=6,
    n_group=3,
    topk_group=2,
    num_experts_per_tok=3,
    num_local_experts=6,
    n_shared_experts=2,
    routed_scaling_factor=2.5,
    linear_head_dim=8,
    linear_num_heads=3,
    linear_conv_kernel_dim=3,
    tie_word_embeddings=False,
)
_CONFIGS["kimi_linear"] = ("KimiLinearConfig", _KIMI)
# attention first, a latent for q, v wider than q.k, every feed-forward a MoE, renormalization off
_CONFIGS["kimi_linear_qlora"] = (
    "KimiLinearConfig",
    dict(_KIMI, layer_types=[_F, _L, _L], num_hidden_layers=3, q_lora_rank=16, v_head_dim=14, mlp_layer_types=["sparse"] * 3, norm_topk_prob=False),
)
_MODEL_CLASSES = {"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}  # else AutoModelForCausalLM's
GDN_KINDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")

KINDS: tuple[str, ...] = tuple(_CONFIGS)


def write_checkpoint(kind: str, path: str | Path, seed: int = 0, **config_overrides: Any) -> Path:
    config_class, base = _CONFIGS[kind]
    tokenizer = build_byte_tokenizer()
    special = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in (("pad", PAD), ("bos", BOS), ("eos", EOS))}
    config = getattr(transformers, config_class)(**{**base, **special, "dtype": "float32", **config_overrides})
    assert config.get_text_config().vocab_size >= len(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind in _MODEL_CLASSES:
            model = getattr(transformers, _MODEL_CLASSES[kind])(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    randomize_decisively(model, seed)
    if kind in GDN_KINDS:
        _center_norms(model)
    if kind.startswith("kimi_linear"):
        _randomize_correction_biases(model, seed)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(str(path))
    return path


def _randomize_correction_biases(model: torch.nn.Module, seed: int) -> None:
    """The routers' e_score_correction_bias (a buffer, which `randomize_decisively` leaves at zero) of
    the size of the sigmoid scores, so that it changes which experts and groups are chosen."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def _center_norms(model: torch.nn.Module) -> None:
    """Zero-centered RMS norms (applied as 1 + weight) around 1, as `randomize_decisively` means them:
    its weights near 1 would double every normalized row. The gated DeltaNet's output norm is a plain one."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name and "visual" not in name:
                p.sub_(1.0)


# The demo model's training script in smoke mode: 10 files, a 512-token vocabulary, 5 steps of 2 x 64 tokens.
DEMO_SMOKE_ARGS = (
    "--device",
    "cpu",
    "--minutes",
    "1",
    "--steps",
    "5",
    "--lr",
    "1e-2",
    "--warmup-steps",
    "1",
    "--max-files",
    "10",
    "--vocab-size",
    "512",
    "--seq-len",
    "64",
    "--batch-size",
    "2",
    "--eval-tokens",
    "256",
)


def train_demo_smoke(out: Path) -> str:
    """Run scripts/train_demo_model.py in smoke mode into `out`; its stdout."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_demo_model.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(out), *DEMO_SMOKE_ARGS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
