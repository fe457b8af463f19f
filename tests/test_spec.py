"""ModelSpec from config.json: layer kinds in every spelling, state shapes, refusals naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engram import LLM, SamplingParams
from engram.models.spec import ConfigError, LayerKind, StateRole, load_model_spec, parse_model_spec

CONFIGS = Path(__file__).parent / "data" / "configs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_shared_configs_parse_to_the_published_layouts():
    granite = load_model_spec(CONFIGS / "granite-4.0-h-tiny.json")
    assert (len(granite.mamba_layers), len(granite.attention_layers)) == (36, 4)
    assert granite.mamba.conv_state_shape == (3, 48 * 64 + 2 * 1 * 128)
    assert granite.mamba.ssm_state_shape == (48, 64, 128)
    nemotron = load_model_spec(CONFIGS / "nemotron-3-nano-30b-a3b.json")
    assert nemotron.layout().count("mamba") == 23 and nemotron.layout().count("attention") == 6
    assert nemotron.layout().count("moe") == 23 and nemotron.attention.num_kv_heads == 2
    codestral = load_model_spec(CONFIGS / "mamba-codestral-7b.json")
    assert codestral.layer_kinds == (LayerKind.MAMBA,) * 64 and codestral.attention is None
    assert codestral.mamba.conv_dim == 8192 + 2 * 8 * 128


def test_recurrent_layers_declare_their_state():
    spec = parse_model_spec(config("granite-4.0-h-tiny"))
    m = spec.mamba
    assert spec.recurrent_layers == spec.mamba_layers
    assert [(t.suffix, t.shape, t.role) for t in spec.state_tensors(spec.mamba_layers[0])] == [
        ("conv", (m.conv_kernel - 1, m.conv_dim), StateRole.CONV),
        ("ssm", (m.num_heads, m.head_dim, m.state_size), StateRole.RECURRENT),
    ]
    assert spec.state_tensors(spec.attention_layers[0]) == ()


def test_gated_deltanet_hybrids_parse_to_the_published_shapes():
    """Qwen3-Next's hub config (layers by full_attention_interval) and Qwen3.5's multimodal one (the
    text model under text_config, layers listed): every 4th layer attention, the GDN state and the
    gated attention with a quarter of each head rotated."""
    for name, layers, experts in (("qwen3-next-80b-a3b", 48, 512), ("qwen3.5-35b-a3b", 40, 256)):
        spec = load_model_spec(CONFIGS / f"{name}.json")
        assert spec.layer_kinds == tuple(LayerKind.ATTENTION if (i + 1) % 4 == 0 else LayerKind.GATED_DELTANET for i in range(layers))
        assert spec.config["num_experts"] == experts and not spec.tie_word_embeddings
        g, a = spec.gated_deltanet, spec.attention
        assert [(t.suffix, t.shape, t.role) for t in spec.state_tensors(0)] == [
            ("conv", (3, 2 * 16 * 128 + 32 * 128), StateRole.CONV),
            ("recurrent", (32, 128, 128), StateRole.RECURRENT),
        ]
        assert g.in_proj_size == 2 * 2048 + 2 * 4096 + 2 * 32
        assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.rope_theta) == (16, 2, 256, 64, 1e7)
        assert a.output_gate and a.qk_norm and spec.mamba is None
    nested = config("qwen3.5-35b-a3b")
    assert load_model_spec(CONFIGS / "qwen3.5-35b-a3b.json").config["model_type"] == "qwen3_5_moe_text"
    flat = dict(nested["text_config"], model_type="qwen3_5_moe_text", tie_word_embeddings=False)
    assert parse_model_spec(flat).layer_kinds == parse_model_spec(nested).layer_kinds


@pytest.mark.parametrize("field", ["linear_num_value_heads", "linear_key_head_dim", "linear_conv_kernel_dim", "head_dim"])
def test_a_gated_deltanet_config_missing_a_dimension_is_refused_naming_the_field(field):
    nested = config("qwen3.5-35b-a3b")
    del nested["text_config"][field]
    with pytest.raises(ConfigError, match=field):
        parse_model_spec(nested)
    with pytest.raises(ConfigError, match="not divisible by linear_num_key_heads"):
        parse_model_spec(dict(config("qwen3-next-80b-a3b"), linear_num_key_heads=12))


def test_old_and_new_layer_type_spellings_are_the_same_model():
    old = config("granite-4.0-h-tiny")
    new = dict(old, layer_types=["linear_attention" if t == "mamba" else "full_attention" for t in old["layer_types"]])
    assert parse_model_spec(old).layer_kinds == parse_model_spec(new).layer_kinds
    pattern = config("nemotron-3-nano-30b-a3b")
    listed = dict(pattern)
    del listed["hybrid_override_pattern"]
    names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    listed["layers_block_type"] = [names[c] for c in pattern["hybrid_override_pattern"]]
    assert parse_model_spec(pattern).layer_kinds == parse_model_spec(listed).layer_kinds


@pytest.mark.parametrize(
    "name,field",
    [("granite-4.0-h-tiny", "mamba_d_state"), ("granite-4.0-h-tiny", "mamba_n_heads"),
     ("nemotron-3-nano-30b-a3b", "ssm_state_size"), ("mamba-codestral-7b", "head_dim"), ("mamba-codestral-7b", "conv_kernel")],
)
def test_a_recurrent_layer_missing_a_dimension_is_refused_naming_the_field(name, field):
    missing = config(name)
    del missing[field]
    with pytest.raises(ConfigError, match=field):
        parse_model_spec(missing)
    zero = dict(config(name), **{field: 0})
    with pytest.raises(ConfigError, match=field):
        parse_model_spec(zero)


def test_unknown_model_type_and_layer_type_are_refused():
    with pytest.raises(ConfigError, match="unsupported model_type"):
        parse_model_spec({"model_type": "llama"})
    bad = dict(config("granite-4.0-h-tiny"), layer_types=["mamba", "conv"])
    with pytest.raises(ConfigError, match="unknown layer type 'conv'"):
        parse_model_spec(bad)


def test_offline_llm_api(checkpoint_dir):
    llm = LLM(checkpoint_dir("bamba"), max_total_tokens=2048)
    outs = llm.generate(["Hello", {"prompt_token_ids": [72, 105]}], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert all(o.finish_reason.value == "length" and isinstance(o.text, str) for o in outs)
    # a string prompt is the tokenizer's encoding of it
    again = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode("Hello", add_special_tokens=False)},
                         SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert again[0].token_ids == outs[0].token_ids
