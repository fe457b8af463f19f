"""Engram's models against transformers on tiny random checkpoints (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import KINDS, write_checkpoint
from engine_utils import assert_greedy_matches_transformers, greedy, make_engine, random_prompt, record_logits, run_to_end


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_greedy_tokens_match_transformers(kind, checkpoint_dir, hf_model):
    path = checkpoint_dir(kind)
    tokens = assert_greedy_matches_transformers(make_engine(path), hf_model(path), random_prompt(37, seed=1), 32)
    assert len(set(tokens)) > 3  # a non-degenerate continuation, so the comparison means something


@pytest.mark.parametrize("kind", ["granite", "nemotron"])
def test_loads_sharded_checkpoint(kind, checkpoint_dir, hf_model, tmp_path):
    ref = hf_model(checkpoint_dir(kind))
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    ref_tokenizer_files = list((tmp_path).glob("*.safetensors"))
    assert len(ref_tokenizer_files) > 1
    engine = make_engine(str(tmp_path))
    prompt = random_prompt(20, seed=2)
    engine.add_request("r", prompt, greedy(8))
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert run_to_end(engine)["r"].token_ids == expected[0, 20:].tolist()


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("falcon_h1", dict(mamba_norm_before_gate=False)),  # the Mamba norm after the gate, as Mamba2's
        ("falcon_h1", dict(num_key_value_heads=4)),  # as many KV heads as query heads
        # an attention head_dim other than hidden / heads; the Mamba width from mamba_expand x hidden
        ("falcon_h1_tied", dict(head_dim=20, mamba_d_ssm=None, mamba_d_head="auto")),
        # LFM2: biases in the short conv and its projections, the MLP width as given, a 4-tap conv
        ("lfm2", dict(conv_bias=True, block_auto_adjust_ff_dim=False, conv_L_cache=4)),
        # a head_dim other than hidden / heads: transformers reads it when the config has one
        ("lfm2", dict(head_dim=8)),
        # attention first and last, untied, the MLP width scaled by block_ffn_dim_multiplier
        ("lfm2", dict(layer_types=["full_attention", "conv", "conv", "full_attention"], tie_word_embeddings=False, block_ffn_dim_multiplier=1.5)),
    ],
)
def test_shape_variants_match_transformers(kind, overrides, hf_model, tmp_path):
    path = str(write_checkpoint(kind, tmp_path, **overrides))
    tokens = assert_greedy_matches_transformers(make_engine(path), hf_model(path), random_prompt(29, seed=5), 32)  # no pad id (0) in it
    assert len(set(tokens)) > 3


@pytest.mark.parametrize(
    "kind, flags, proj_bias, attention_bias",
    [
        ("granite", dict(attention_bias=True, mamba_proj_bias=True), True, True),
        # transformers builds Nemotron-H's attention without biases whatever attention_bias says, and
        # gives its Mamba2 projections biases by use_bias (mamba_proj_bias is not read)
        ("nemotron", dict(attention_bias=True), False, False),
        ("nemotron", dict(use_bias=True), True, False),
        ("nemotron", dict(mamba_proj_bias=True), False, False),
        # every bias Falcon-H1 has; the multipliers scale them too (the key's bias by key_multiplier)
        ("falcon_h1", dict(attention_bias=True, mamba_proj_bias=True, projectors_bias=True, mlp_bias=True), True, True),
    ],
)
def test_bias_flags_read_as_transformers(kind, flags, proj_bias, attention_bias, hf_model, tmp_path):
    """A checkpoint that transformers saves with a bias flag set loads and gives its logits."""
    path = str(write_checkpoint(kind, tmp_path, **flags))
    ref = hf_model(path)
    names = [name for name, _ in ref.named_parameters()]
    assert any(n.endswith("in_proj.bias") for n in names) == proj_bias
    assert any(n.endswith("q_proj.bias") for n in names) == attention_bias
    engine = make_engine(path)
    logits = record_logits(engine)
    prompt = random_prompt(21, seed=3)
    engine.add_request("r", prompt, greedy(1))
    run_to_end(engine)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt])).logits[0, -1]
    assert (logits[0][0] - ref_logits).abs().max().item() < 1e-4
