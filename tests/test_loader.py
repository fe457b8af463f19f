"""Checkpoint tensors land where the model reads them: packed projections by rows, and a clear
error for a tensor with no place or a parameter the checkpoint lacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from safetensors.torch import load_file

from engram.models.loader import WeightLoadError, load_model, load_model_from_state_dict, safetensors_files
from engram.models.spec import load_model_spec


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    path = write_checkpoint("granite", tmp_path_factory.mktemp("granite"))
    tensors = {}
    for file in safetensors_files(path):
        tensors.update(load_file(file))
    return load_model_spec(path), path, tensors


def test_q_k_v_fill_the_rows_of_the_packed_projection(granite):
    spec, path, tensors = granite
    model = load_model(spec, path, torch.float32, torch.device("cpu"))
    layer = spec.attention_layers[0]
    qkv = model.layers[layer].mixer.qkv_proj.weight
    parts = [tensors[f"model.layers.{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(qkv, torch.cat(parts).float())


def test_a_missing_part_and_a_stray_tensor_are_errors(granite):
    spec, _, tensors = granite
    layer = spec.attention_layers[0]
    lacking = {k: v for k, v in tensors.items() if k != f"model.layers.{layer}.self_attn.v_proj.weight"}
    q, kv = spec.attention.num_heads * spec.attention.head_dim, spec.attention.num_kv_heads * spec.attention.head_dim
    rows = rf"rows {q + kv}:{q + 2 * kv}"  # v's rows of the packed projection
    with pytest.raises(WeightLoadError, match=rf"lacks weights: .*layers\.{layer}\.mixer\.qkv_proj\.weight \({rows}\)"):
        load_model_from_state_dict(spec, lacking, torch.float32, torch.device("cpu"))
    stray = dict(tensors, **{"model.extra.weight": torch.zeros(2)})
    with pytest.raises(WeightLoadError, match="'model.extra.weight' has no place"):
        load_model_from_state_dict(spec, stray, torch.float32, torch.device("cpu"))


def test_falcon_h1_multipliers_are_folded_into_the_loaded_projections_once(tmp_path):
    path = write_checkpoint("falcon_h1", tmp_path)
    spec, tensors = load_model_spec(path), load_file(path / "model.safetensors")
    cfg = spec.config
    block = load_model(spec, path, torch.float32, torch.device("cpu")).layers[1]
    k_rows = slice(spec.attention.num_heads * spec.attention.head_dim, None)
    key = tensors["model.layers.1.self_attn.k_proj.weight"] * cfg["attention_in_multiplier"] * cfg["key_multiplier"]
    torch.testing.assert_close(block.mixer.attention.qkv_proj.weight[k_rows][: key.shape[0]], key)
    dt = tensors["model.layers.1.mamba.in_proj.weight"][-spec.mamba.num_heads :] * cfg["ssm_in_multiplier"] * cfg["ssm_multipliers"][4]
    torch.testing.assert_close(block.mixer.mamba.in_proj.weight[-spec.mamba.num_heads :], dt)
    down = tensors["model.layers.1.feed_forward.down_proj.weight"] * cfg["mlp_multipliers"][1]
    torch.testing.assert_close(block.ffn.down_proj.weight, down)


def test_falcon_h1_multiplier_lists_of_the_wrong_length_are_refused(tmp_path):
    from engram.models.falcon_h1 import FalconH1ForCausalLM
    from engram.models.spec import ConfigError, parse_model_spec

    spec = load_model_spec(write_checkpoint("falcon_h1", tmp_path))
    bad = parse_model_spec(dict(spec.config, ssm_multipliers=[1.0, 2.0]))
    with torch.device("meta"), pytest.raises(ConfigError, match=r"ssm_multipliers must be a list of 5 numbers, got \[1.0, 2.0\]"):
        FalconH1ForCausalLM(bad)


@pytest.mark.parametrize(
    "dropped, missing",
    [
        (
            "model.layers.0.linear_attn.in_proj_ba.weight",
            r"layers\.0\.mixer\.in_proj\.weight \(rows 112:120\)",
        ),  # b and a, past q, k, v (80 rows) and z (32)
        ("model.layers.1.mlp.experts.2.up_proj.weight", r"layers\.1\.mlp\.experts\.gate_up_proj \(rows 2:3\)"),  # expert 2's up half
    ],
)
def test_a_missing_part_of_an_interleaved_or_expert_projection_is_named(dropped, missing, checkpoint_dir):
    """Qwen3-Next's in_proj_ba lands on scattered rows of the GDN's packed projection, an expert's up
    projection on half of its stacked rows: a checkpoint without one is refused naming the rows."""
    path = checkpoint_dir("qwen3_next")
    tensors = load_file(safetensors_files(Path(path))[0])
    assert dropped in tensors
    lacking = {k: v for k, v in tensors.items() if k != dropped}
    with pytest.raises(WeightLoadError, match=rf"lacks weights: .*{missing}"):
        load_model_from_state_dict(load_model_spec(path), lacking, torch.float32, torch.device("cpu"))
