"""Checkpoint tensors land where the model reads them: packed projections by rows, and a clear
error for a tensor with no place or a parameter the checkpoint lacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from safetensors.torch import load_file

from engram.models.loader import WeightLoadError, load_model, load_model_from_state_dict, safetensors_files
from engram.models.spec import LayerKind, load_model_spec


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
    layer = next(i for i, kind in enumerate(spec.layer_kinds) if kind == LayerKind.ATTENTION)
    qkv = model.layers[layer].mixer.qkv_proj.weight
    parts = [tensors[f"model.layers.{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(qkv, torch.cat(parts).float())


def test_a_missing_part_and_a_stray_tensor_are_errors(granite):
    spec, _, tensors = granite
    layer = next(i for i, kind in enumerate(spec.layer_kinds) if kind == LayerKind.ATTENTION)
    lacking = {k: v for k, v in tensors.items() if k != f"model.layers.{layer}.self_attn.v_proj.weight"}
    q, kv = spec.attention.num_heads * spec.attention.head_dim, spec.attention.num_kv_heads * spec.attention.head_dim
    rows = rf"rows {q + kv}:{q + 2 * kv}"  # v's rows of the packed projection
    with pytest.raises(WeightLoadError, match=rf"lacks weights: .*layers\.{layer}\.mixer\.qkv_proj\.weight \({rows}\)"):
        load_model_from_state_dict(spec, lacking, torch.float32, torch.device("cpu"))
    stray = dict(tensors, **{"model.extra.weight": torch.zeros(2)})
    with pytest.raises(WeightLoadError, match="'model.extra.weight' has no place"):
        load_model_from_state_dict(spec, stray, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(
    "dropped, missing",
    [
        ("model.layers.0.linear_attn.in_proj_ba.weight", r"layers\.0\.mixer\.in_proj\.weight \(rows 112:120\)"),  # b and a, past q, k, v (80 rows) and z (32)
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
