"""Memory planner and `engram plan`: figures pinned against hand computation for real configs."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engram.args import EngineArgs
from engram.engine.memory_planner import (
    MemoryPlanError,
    device_memory_bytes,
    kv_bytes_per_token,
    plan_for_args,
    plan_memory,
    require_fit,
    scratch_bytes,
    state_bytes_by_kind,
    state_bytes_per_seq,
    state_dtypes,
    weights_bytes,
)
from engram.models.spec import load_model_spec, parse_model_spec
from engram.plan import main as plan_main
from engram.state.sequence_state import StateDtypes

CONFIGS = Path(__file__).parent / "data" / "configs"
NEMOTRON = CONFIGS / "nemotron-3-nano-30b-a3b.json"
GRANITE = CONFIGS / "granite-4.0-h-tiny.json"
CODESTRAL = CONFIGS / "mamba-codestral-7b.json"
FALCON_H1 = CONFIGS / "falcon-h1-7b-instruct.json"
QWEN3_NEXT = CONFIGS / "qwen3-next-80b-a3b.json"
QWEN3_5 = CONFIGS / "qwen3.5-35b-a3b.json"  # the multimodal checkpoint's config: its text model is planned
LFM2 = CONFIGS / "lfm2-1.2b.json"  # LFM2-1.2B's shapes in the legacy field names (block_ff_dim, tie_embedding)
KIMI_LINEAR = CONFIGS / "kimi-linear-48b-a3b.json"  # the checkpoint's field names (linear_attn_config, num_experts, ...)

F32, BF16 = 4, 2
# float32 SSM state, bfloat16 conv state and KV (the defaults for these bfloat16 checkpoints)
DEFAULT_DTYPES = StateDtypes(conv=torch.bfloat16, ssm=torch.float32, kv=torch.bfloat16)


def _state(layers: int, heads: int, head_dim: int, d_state: int, n_groups: int) -> int:
    """Hand computation: SSM heads x head_dim x d_state (f32) + conv 3 x (d_inner + 2 G N) (bf16)."""
    conv_dim = heads * head_dim + 2 * n_groups * d_state
    return layers * (heads * head_dim * d_state * F32 + 3 * conv_dim * BF16)


def _nemotron_params() -> int:
    h, v = 2688, 131072
    mamba = h + 10304 * h + 6144 * 4 + 6144 + 3 * 64 + 4096 + 4096 * h  # in_proj: 2*4096 + 2*8*128 + 64
    moe = h + 2 * 128 * 1856 * h + 128 * h + 128 + 2 * 3712 * h  # relu2 experts (up, down), router + bias, shared
    attention = h + 32 * 128 * h + 2 * 2 * 128 * h + h * 32 * 128
    return 2 * v * h + h + 23 * mamba + 23 * moe + 6 * attention  # untied embeddings and lm_head


def _granite_params() -> int:
    h, v = 1536, 100352
    every_layer = 2 * h + 64 * h + 64 * 2 * 512 * h + 64 * h * 512 + 2 * 1024 * h + h * 1024  # norms, MoE, shared MLP
    mamba = 3 * 48 + 3328 * 4 + 3328 + 6448 * h + 3072 + 3072 * h  # conv_dim 3072 + 2*128; in_proj 2*3072 + 256 + 48
    attention = 2 * h * 12 * 128 + 2 * h * 4 * 128
    return v * h + h + 40 * every_layer + 36 * mamba + 4 * attention  # tied: embeddings once


def _codestral_params() -> int:
    h, v = 4096, 32768
    layer = h + h * (2 * 8192 + 2 * 8 * 128 + 128) + 10240 * 4 + 10240 + 3 * 128 + 8192 + 8192 * h
    return 2 * v * h + h + 64 * layer


def _falcon_h1_params() -> int:
    h, v = 3072, 130048
    mamba = h * (2 * 3072 + 2 * 256 + 24) + 3584 * 4 + 3584 + 3 * 24 + 3072 * h  # no norm (mamba_rms_norm false)
    attention = h * 12 * 128 + 2 * h * 2 * 128 + 12 * 128 * h
    layer = 2 * h + mamba + attention + 3 * h * 12288  # norms, both mixers, gated MLP
    return 2 * v * h + h + 44 * layer


def _gdn_state(layers: int, k_heads: int, v_heads: int, head_dim: int, kernel: int) -> int:
    """Hand computation: recurrent v_heads x head_dim x head_dim (f32) + conv (kernel - 1) x (2 k + v) (bf16)."""
    conv_dim = (2 * k_heads + v_heads) * head_dim
    return layers * (v_heads * head_dim * head_dim * F32 + (kernel - 1) * conv_dim * BF16)


def _qwen_gdn_params(vocab: int, layers: int, attention_layers: int, experts: int) -> int:
    """Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B: hidden 2048; GDN 16 q/k heads, 32 value heads of 128; gated attention
    16 heads, 2 KV heads of 256; MoE experts of 512 with a shared expert of 512 and its gate; untied."""
    h = 2048
    gdn = h * (2 * 2048 + 2 * 4096 + 2 * 32) + 8192 * 4 + 2 * 32 + 128 + 4096 * h  # q k v z b a; conv; dt_bias, A_log; norm; out
    attention = h * 2 * 4096 + 2 * h * 512 + 4096 * h + 2 * 256  # q with its gate, k, v, o; q and k norms
    every_layer = 2 * h + experts * h + experts * 3 * 512 * h + 3 * 512 * h + h  # norms, router, experts, shared and its gate
    return 2 * vocab * h + h + layers * every_layer + (layers - attention_layers) * gdn + attention_layers * attention


def _lfm2_params() -> int:
    """LFM2-1.2B: hidden 2048, 10 short convs (kernel 3), 6 attention layers of 32 heads, 8 KV heads of 64 with q/k
    norms; the MLP 2/3 of block_ff_dim 12288; tied embeddings."""
    h = 2048
    conv = 3 * h * h + 3 * h + h * h  # in_proj (B, C, x), depthwise taps, out_proj
    attention = 2 * h * h + 2 * h * 512 + 2 * 64  # q, o; k, v; q and k norms
    every_layer = 2 * h + 3 * h * 8192
    return 65536 * h + h + 16 * every_layer + 10 * conv + 6 * attention


def _kimi_linear_params() -> int:
    """Kimi-Linear-48B-A3B: hidden 2304; 20 KDA layers of 32 heads of 128 (decay and gate of rank 128); 7 latent
    attention layers, 32 heads, latent 512 + 64 shared key channels, k 128 + 64 and v 128 per head; a dense
    first MLP of 9216, then 256 experts of 1024 with a shared one; untied. Router biases are buffers and count."""
    h, qkv = 2304, 4096
    kda = 3 * qkv * h + 3 * qkv * 4 + 2 * (128 * h + qkv * 128) + qkv + 32 + 32 * h + 128 + h * qkv  # q k v, convs, f, g, dt_bias, A_log, b, norm, o
    mla = 32 * 192 * h + 576 * h + 512 + 512 * 32 * 256 + 32 * 128 * h  # q, kv_a and its norm, kv_b, o
    moe = 256 * h + 256 + 256 * 3 * 1024 * h + 3 * 1024 * h
    return 2 * 163840 * h + h + 27 * 2 * h + 20 * kda + 7 * mla + 3 * h * 9216 + 26 * moe


FIGURES = {
    # config: (state bytes per sequence, KV bytes per token, parameters)
    NEMOTRON: (_state(23, 64, 64, 128, 8), 2 * 6 * 2 * 128 * BF16, _nemotron_params()),
    GRANITE: (_state(36, 48, 64, 128, 1), 2 * 4 * 4 * 128 * BF16, _granite_params()),
    CODESTRAL: (_state(64, 128, 64, 128, 8), 0, _codestral_params()),
    # every layer keeps a Mamba2 state and KV
    FALCON_H1: (_state(44, 24, 128, 256, 1), 2 * 44 * 2 * 128 * BF16, _falcon_h1_params()),
    QWEN3_NEXT: (_gdn_state(36, 16, 32, 128, 4), 12 * 2 * 2 * 256 * BF16, _qwen_gdn_params(151936, 48, 12, 512)),
    QWEN3_5: (_gdn_state(30, 16, 32, 128, 4), 10 * 2 * 2 * 256 * BF16, _qwen_gdn_params(248320, 40, 10, 256)),
    # a conv window of 2 inputs over the hidden width in each short-conv layer
    LFM2: (10 * 2 * 2048 * BF16, 6 * 2 * 8 * 64 * BF16, _lfm2_params()),
    # KV expanded to every head, V padded to K's 192 channels (layers/latent_attention.py)
    KIMI_LINEAR: (_gdn_state(20, 32, 32, 128, 4), 7 * 2 * 32 * 192 * BF16, _kimi_linear_params()),
}


@pytest.mark.parametrize("config", FIGURES, ids=lambda p: p.stem)
def test_figures_match_hand_computation(config: Path) -> None:
    state, kv, params = FIGURES[config]
    spec = load_model_spec(config)
    dtypes = state_dtypes(spec, torch.bfloat16, "float32", "auto")
    assert dtypes == DEFAULT_DTYPES
    assert state_bytes_per_seq(spec, dtypes) == state
    assert sum(state_bytes_by_kind(spec, dtypes).values()) == state
    assert kv_bytes_per_token(spec, dtypes) == kv
    assert weights_bytes(config, torch.bfloat16) == params * BF16


def test_pinned_figures() -> None:
    # The figure: Nemotron 3 Nano, all state in float32, about 47.6 MiB per sequence.
    spec = load_model_spec(NEMOTRON)
    all_f32 = state_dtypes(spec, torch.float32, "auto", "auto")
    assert state_bytes_per_seq(spec, all_f32) == 23 * (64 * 64 * 128 + 3 * 6144) * F32 == 49_930_240
    assert state_bytes_per_seq(spec, DEFAULT_DTYPES) == 49_082_368
    assert state_bytes_by_kind(spec, DEFAULT_DTYPES) == {"mamba.conv": 23 * 3 * 6144 * BF16, "mamba.ssm": 23 * 64 * 64 * 128 * F32}
    assert _nemotron_params() == 31_577_940_288
    assert _granite_params() == 6_939_037_248
    assert _codestral_params() == 7_285_403_648
    assert _falcon_h1_params() == 7_585_513_568
    assert _lfm2_params() == 1_170_340_608  # LFM2-1.2B's model card: 1.17B parameters
    assert _kimi_linear_params() == 49_122_681_728  # the model card's 48B total parameters
    kimi = load_model_spec(KIMI_LINEAR)
    assert state_bytes_by_kind(kimi, DEFAULT_DTYPES) == {"kda.conv": 20 * 3 * 3 * 4096 * BF16, "kda.recurrent": 20 * 32 * 128 * 128 * F32}
    falcon = load_model_spec(FALCON_H1)
    assert state_bytes_by_kind(falcon, DEFAULT_DTYPES) == {"mamba.conv": 44 * 3 * 3584 * BF16, "mamba.ssm": 44 * 24 * 128 * 256 * F32}


def test_scratch_formula() -> None:
    spec = load_model_spec(NEMOTRON)
    projections = 4 * 2048 * 10304 * BF16  # widest activation: the Mamba in_proj
    scan = math.ceil(2048 / 128) * 64 * 64 * 128 * F32  # one float32 state per scan chunk
    logits = 2 * 16 * 131072 * F32
    assert scratch_bytes(spec, 2048, 16, torch.bfloat16) == projections + scan + logits


def test_cuda_graphs_count_a_second_forward_scratch() -> None:
    """The graphs' private pool holds a captured step's activations beside the eager steps' ones."""
    spec = load_model_spec(NEMOTRON)
    one = scratch_bytes(spec, 2048, 16, torch.bfloat16)

    def plan(graphs: bool) -> int:
        args = EngineArgs(model_path="unused", max_running_requests=16, max_num_batched_tokens=2048)
        return plan_for_args(
            spec, args, model_dtype=torch.bfloat16, total_memory_bytes=141 * 2**30, weights_bytes=0, cuda_graphs=graphs
        ).scratch_bytes

    assert plan(True) == 2 * one and plan(False) == one


def test_no_recurrent_layers_means_no_state() -> None:
    cfg = json.loads(GRANITE.read_text())
    cfg["layer_types"] = ["attention"] * cfg["num_hidden_layers"]
    spec = parse_model_spec(cfg)
    dtypes = state_dtypes(spec, torch.bfloat16, "float32", "auto")
    assert state_bytes_per_seq(spec, dtypes) == 0
    assert state_bytes_by_kind(spec, dtypes) == {}
    assert kv_bytes_per_token(spec, dtypes) == 2 * 40 * 4 * 128 * BF16


def test_dtype_flags() -> None:
    spec = load_model_spec(GRANITE)
    assert state_dtypes(spec, torch.float16, "auto", "float32") == StateDtypes(torch.float16, torch.float16, torch.float32)
    with pytest.raises(ValueError, match="--mamba-ssm-dtype"):
        state_dtypes(spec, torch.bfloat16, "fp8", "auto")
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        state_dtypes(spec, torch.bfloat16, "float32", "int8")


def _plan(spec, **overrides):
    kwargs = dict(
        total_memory_bytes=100 << 30,
        mem_fraction_static=0.5,
        weights_bytes=10 << 30,
        scratch_bytes=1 << 30,
        max_running_requests=16,
        context_length=None,
        dtypes=DEFAULT_DTYPES,
        kv_block_size=16,
        margin_bytes=256 << 20,
    )
    return plan_memory(spec, **{**kwargs, **overrides})


def test_kv_gets_exactly_what_is_left() -> None:
    spec = load_model_spec(NEMOTRON)
    state = 16 * 49_082_368
    page = 16 * 6144
    kv = 1000 * page
    total = 2 * ((10 << 30) + (1 << 30) + state + (256 << 20) + kv)  # fraction 0.5
    plan = require_fit(_plan(spec, total_memory_bytes=total))
    assert plan.budget_bytes == total // 2
    free = plan.budget_bytes - (10 << 30)  # after weights
    assert plan.state_cache_bytes == state
    assert plan.kv_cache_bytes == free - (1 << 30) - state - (256 << 20) == kv
    assert (plan.num_kv_blocks, plan.max_total_tokens) == (1000, 16000)
    assert plan.context_length == 16000  # max_position_embeddings capped by the KV cache
    assert plan.shortfall_bytes == 0
    # One byte less: the partial page is not handed out.
    assert _plan(spec, total_memory_bytes=total - 2).num_kv_blocks == 999


def test_state_larger_than_free_memory_names_max_running_requests() -> None:
    spec = load_model_spec(CODESTRAL)  # 259.75 MiB per sequence
    plan = _plan(spec, max_running_requests=1000)
    assert not plan.fits
    assert "--max-running-requests" in plan.error and "259.75 MiB per sequence" in plan.error
    free = plan.budget_bytes - plan.weights_bytes - plan.scratch_bytes - plan.margin_bytes
    assert f"at most {free // plan.state_bytes_per_seq}" in plan.error
    assert plan.state_cache_bytes == 1000 * plan.state_bytes_per_seq
    assert plan.shortfall_bytes == plan.state_cache_bytes - free
    with pytest.raises(MemoryPlanError, match="--max-running-requests"):
        require_fit(plan)


def test_weights_larger_than_budget() -> None:
    plan = _plan(load_model_spec(GRANITE), weights_bytes=60 << 30)
    assert not plan.fits and "--mem-fraction-static" in plan.error
    assert plan.shortfall_bytes > 10 << 30


def test_context_that_kv_cannot_hold_names_context_length() -> None:
    spec = load_model_spec(NEMOTRON)
    plan = _plan(spec, context_length=10_000_000)
    assert not plan.fits
    assert "--context-length" in plan.error and "--max-total-tokens" in plan.error
    needed = plan.weights_bytes + plan.scratch_bytes + plan.margin_bytes + plan.state_cache_bytes + 10_000_000 * 6144
    assert plan.shortfall_bytes == needed - plan.budget_bytes


def test_explicit_max_total_tokens() -> None:
    spec = load_model_spec(NEMOTRON)
    plan = require_fit(_plan(spec, max_total_tokens=1000, context_length=1000))
    assert (plan.max_total_tokens, plan.num_kv_blocks, plan.kv_cache_bytes) == (1000, 63, 63 * 16 * 6144)
    too_small = _plan(spec, max_total_tokens=1000, context_length=4096)
    assert "--max-total-tokens 1000" in too_small.error and "--context-length 4096" in too_small.error
    too_big = _plan(spec, max_total_tokens=100_000_000)
    assert "--max-total-tokens" in too_big.error and too_big.shortfall_bytes > 0


def test_attention_free_model_needs_no_kv() -> None:
    plan = require_fit(_plan(load_model_spec(CODESTRAL), context_length=8192))
    assert (plan.kv_bytes_per_token, plan.kv_cache_bytes, plan.num_kv_blocks) == (0, 0, 0)
    assert plan.max_total_tokens == 8192 * 16


def test_device_memory_on_cpu_is_the_configured_budget() -> None:
    assert device_memory_bytes("cpu", 2.5) == int(2.5 * (1 << 30))
    with pytest.raises(ValueError, match="--device"):
        device_memory_bytes("meta", 1.0)


def test_weights_of_a_multimodal_checkpoint_are_its_language_model(checkpoint_dir, hf_model) -> None:
    """A Qwen3.5 checkpoint's vision tower is not loaded, so not counted: the text model's parameters are."""
    path = checkpoint_dir("qwen3_5_moe")
    assert any("visual" in name for name in safe_open_names(path))
    assert weights_bytes(path, torch.float32) == sum(p.numel() for p in hf_model(path).parameters()) * F32


def safe_open_names(path: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def test_weights_from_safetensors_headers(tmp_path: Path) -> None:
    cfg = json.loads(CODESTRAL.read_text())
    tensors = {"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.float16), "lm_head.weight": torch.zeros(4, 2)}
    save_file({"a": tensors["a"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in ("b", "lm_head.weight")}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert weights_bytes(tmp_path, torch.bfloat16) == (15 + 7 + 8) * BF16
    assert weights_bytes(tmp_path / "config.json", torch.float32) == (15 + 7 + 8) * F32
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    assert weights_bytes(tmp_path, torch.bfloat16) == (15 + 7) * BF16


def _run_plan(capsys, *argv: str) -> tuple[int, str]:
    rc = plan_main(list(argv))
    return rc, capsys.readouterr().out


def test_plan_json_has_every_field_when_not_fitting(capsys) -> None:
    rc, out = _run_plan(capsys, "--model-path", str(CODESTRAL), "--max-running-requests", "1000", "--json")
    assert rc == 1
    data = json.loads(out)
    for field in (
        "weights_bytes",
        "state_bytes_per_seq",
        "state_bytes_by_kind",
        "state_cache_bytes",
        "kv_bytes_per_token",
        "kv_cache_bytes",
        "max_total_tokens",
        "fits",
        "total_memory_bytes",
        "budget_bytes",
        "scratch_bytes",
        "shortfall_bytes",
        "kv_block_size",
        "num_kv_blocks",
        "context_length",
        "max_running_requests",
        "error",
    ):
        assert field in data, field
    assert data["fits"] is False and data["shortfall_bytes"] > 0
    assert data["weights_bytes"] == _codestral_params() * BF16
    assert data["state_cache_bytes"] == 1000 * FIGURES[CODESTRAL][0]
    assert data["total_memory_bytes"] == 80 << 30
    assert "--max-running-requests" in data["error"]


def test_plan_human_output(capsys, tmp_path: Path) -> None:
    shutil.copy(GRANITE, tmp_path / "config.json")  # a folder holding only config.json
    rc, out = _run_plan(capsys, "--model-path", str(tmp_path), "--gpu-memory-gb", "24")
    assert rc == 0
    for label in ("weights", "forward scratch", "state cache", "mamba.ssm", "KV per token", "KV cache", "max total tokens", "fits: yes"):
        assert label in out, label
    rc, out = _run_plan(capsys, "--model-path", str(tmp_path), "--gpu-memory-gb", "8")
    assert rc == 1 and "fits: NO, short by" in out


def test_plan_of_kimi_linear_lists_its_kda_state_and_expanded_kv(capsys) -> None:
    """Kimi-Linear-48B-A3B in bfloat16 (91.5 GiB) fits an H200, not an 80 GiB card."""
    rc, out = _run_plan(capsys, "--model-path", str(KIMI_LINEAR), "--gpu-memory-gb", "141", "--json")
    data = json.loads(out)
    assert rc == 0 and data["fits"] and data["max_total_tokens"] > 0
    assert data["state_bytes_by_kind"] == {"kda.conv": 20 * 3 * 3 * 4096 * BF16, "kda.recurrent": 20 * 32 * 128 * 128 * F32}
    assert data["kv_bytes_per_token"] == 168 << 10
    rc, out = _run_plan(capsys, "--model-path", str(KIMI_LINEAR))
    assert rc == 1 and "layers: 20 kda, 7 attention" in out and "fits: NO" in out


def test_plan_bad_flag(capsys) -> None:
    assert plan_main(["--model-path", str(GRANITE), "--kv-cache-dtype", "fp8"]) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err


def test_plan_module_subprocess() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "engram.plan", "--model-path", str(NEMOTRON), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    state, kv, params = FIGURES[NEMOTRON]
    assert (data["state_bytes_per_seq"], data["kv_bytes_per_token"], data["weights_bytes"]) == (state, kv, params * BF16)
    assert data["state_cache_bytes"] == 16 * state and data["fits"] is True
    assert data["max_total_tokens"] == data["num_kv_blocks"] * 16
    assert data["kv_cache_bytes"] == data["max_total_tokens"] * kv
