"""Checkpoint tensors land where the model reads them: packed projections by rows, and a clear
error for a tensor with no place or a parameter the checkpoint lacks."""

from __future__ import annotations

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
