"""ModelSpec from config.json: layer kinds in every spelling, state shapes, refusals naming the field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engram import LLM, SamplingParams
from engram.engine.memory_planner import state_bytes_by_kind, state_bytes_per_seq
from engram.engine.pools import KVPool, StatePool
from engram.models.spec import ConfigError, GateNorm, LayerKind, StateRole, load_model_spec, parse_model_spec
from engram.state.sequence_state import StateDtypes, expected_tensors

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
    assert codestral.layer_mixers == ((LayerKind.MAMBA,),) * 64 and codestral.attention is None
    assert codestral.mamba.conv_dim == 8192 + 2 * 8 * 128
    falcon = load_model_spec(CONFIGS / "falcon-h1-7b-instruct.json")
    assert falcon.layer_mixers == ((LayerKind.MAMBA, LayerKind.ATTENTION),) * 44
    assert falcon.mamba.conv_state_shape == (3, 3072 + 2 * 256) and falcon.mamba.ssm_state_shape == (24, 128, 256)
    assert falcon.mamba.gate_norm == GateNorm.NONE and falcon.mamba.chunk_size == 128
    a = falcon.attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.rope_theta) == (12, 2, 128, 128, 1e11)


def test_recurrent_layers_declare_their_state():
    spec = parse_model_spec(config("granite-4.0-h-tiny"))
    m = spec.mamba
    assert spec.recurrent_layers == spec.mamba_layers
    assert [(t.suffix, t.shape, t.role) for t in spec.state_tensors(spec.mamba_layers[0])] == [
        ("conv", (m.conv_kernel - 1, m.conv_dim), StateRole.CONV),
        ("ssm", (m.num_heads, m.head_dim, m.state_size), StateRole.RECURRENT),
    ]
    assert spec.state_tensors(spec.attention_layers[0]) == ()


def test_a_layer_of_two_mixers_keeps_the_state_of_both():
    """Mamba2 beside attention in every layer (Falcon-H1's shape): each layer declares its conv and
    SSM state and has KV, and everything sized from the spec follows from that."""
    one_each = parse_model_spec(config("granite-4.0-h-tiny"))
    n = one_each.num_layers
    both = dataclasses.replace(one_each, layer_mixers=((LayerKind.MAMBA, LayerKind.ATTENTION),) * n)
    assert both.mamba_layers == both.attention_layers == both.recurrent_layers == list(range(n))
    assert both.layout() == ["mamba+attention"] * n and both.is_hybrid
    assert both.state_tensors(7) == one_each.state_tensors(one_each.mamba_layers[0])
    dtypes = StateDtypes(conv=torch.float32, ssm=torch.float32, kv=torch.float32)
    names = expected_tensors(both, dtypes, 3)
    assert set(names) == {f"layers.{i}.{t}" for i in range(n) for t in ("conv", "ssm", "k", "v")}
    kv_heads, head_dim = both.attention.num_kv_heads, both.attention.head_dim
    assert names["layers.5.k"] == ((3, kv_heads, head_dim), torch.float32)
    mamba_only = state_bytes_by_kind(one_each, dtypes)
    assert state_bytes_by_kind(both, dtypes) == {key: nbytes // 36 * n for key, nbytes in mamba_only.items()}
    assert state_bytes_per_seq(both, dtypes) == sum(state_bytes_by_kind(both, dtypes).values())
    small = dataclasses.replace(both, layer_mixers=both.layer_mixers[:2])
    state_pool, kv_pool = StatePool(small, 2, dtypes, torch.device("cpu")), KVPool(small, 4, 16, torch.float32, torch.device("cpu"))
    assert state_pool.of(1, "ssm").shape == (2, *both.mamba.ssm_state_shape) and sorted(kv_pool.k) == [0, 1]
    with pytest.raises(ConfigError, match=r"layer 0's mixers mamba\+mamba declare the same state twice"):
        dataclasses.replace(one_each, layer_mixers=((LayerKind.MAMBA, LayerKind.MAMBA),) * n)


def test_gated_deltanet_hybrids_parse_to_the_published_shapes():
    """Qwen3-Next's hub config (layers by full_attention_interval) and Qwen3.5's multimodal one (the
    text model under text_config, layers listed): every 4th layer attention, the GDN state and the
    gated attention with a quarter of each head rotated."""
    for name, layers, experts in (("qwen3-next-80b-a3b", 48, 512), ("qwen3.5-35b-a3b", 40, 256)):
        spec = load_model_spec(CONFIGS / f"{name}.json")
        assert spec.layer_mixers == tuple((LayerKind.ATTENTION if (i + 1) % 4 == 0 else LayerKind.GATED_DELTANET,) for i in range(layers))
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
    assert parse_model_spec(flat).layer_mixers == parse_model_spec(nested).layer_mixers


@pytest.mark.parametrize("field", ["linear_num_value_heads", "linear_key_head_dim", "linear_conv_kernel_dim", "head_dim"])
def test_a_gated_deltanet_config_missing_a_dimension_is_refused_naming_the_field(field):
    nested = config("qwen3.5-35b-a3b")
    del nested["text_config"][field]
    with pytest.raises(ConfigError, match=field):
        parse_model_spec(nested)
    with pytest.raises(ConfigError, match="not divisible by linear_num_key_heads"):
        parse_model_spec(dict(config("qwen3-next-80b-a3b"), linear_num_key_heads=12))


def test_lfm2_parses_to_its_published_shapes_in_either_field_spelling():
    """LFM2-1.2B in its hub config's legacy names (full_attn_idxs, block_ff_dim, tie_embedding) and in the
    names transformers writes: short convs keeping a window of conv_L_cache - 1 inputs, attention at 6 layers."""
    legacy = config("lfm2-1.2b")
    spec = parse_model_spec(legacy)
    S, A = LayerKind.SHORT_CONV, LayerKind.ATTENTION
    assert spec.layer_mixers == tuple((A,) if i in (2, 5, 8, 10, 12, 14) else (S,) for i in range(16))
    assert spec.recurrent_layers == spec.short_conv_layers and len(spec.short_conv_layers) == 10
    assert [(t.suffix, t.shape, t.role) for t in spec.state_tensors(0)] == [("conv", (2, 2048), StateRole.CONV)]
    a = spec.attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.rope_theta) == (32, 8, 64, 64, 1e6)
    assert a.qk_norm and not a.qk_norm_zero_centered and not a.output_gate
    assert spec.tie_word_embeddings and spec.config["intermediate_size"] == 12288
    renamed = {k: v for k, v in legacy.items() if k not in ("full_attn_idxs", "block_ff_dim", "tie_embedding")}
    renamed.update(layer_types=["full_attention" if k == A else "conv" for (k,) in spec.layer_mixers], intermediate_size=12288)
    assert parse_model_spec(renamed).layer_mixers == spec.layer_mixers
    assert parse_model_spec(renamed).tie_word_embeddings  # transformers' default for LFM2
    assert not parse_model_spec(dict(renamed, tie_word_embeddings=False)).tie_word_embeddings
    for field in ("conv_L_cache", "full_attn_idxs"):
        with pytest.raises(ConfigError, match=field):
            parse_model_spec({k: v for k, v in legacy.items() if k != field})


def test_kimi_linear_parses_to_its_published_shapes_in_either_field_spelling():
    """Kimi-Linear-48B-A3B's hub config (1-based linear_attn_config lists, the checkpoint's MoE names) and
    the names transformers writes: attention at 7 layers, KDA's conv window over q, k and v and its
    state per head, latent attention's K and V expanded to every head (V padded to K's 192 channels)."""
    hub = config("kimi-linear-48b-a3b")
    spec = parse_model_spec(hub)
    K, A = LayerKind.KDA, LayerKind.ATTENTION
    assert spec.layer_mixers == tuple((A,) if i in (3, 7, 11, 15, 19, 23, 26) else (K,) for i in range(27))
    assert [(t.suffix, t.shape, t.role) for t in spec.state_tensors(0)] == [
        ("conv", (3, 3 * 32 * 128), StateRole.CONV),
        ("recurrent", (32, 128, 128), StateRole.RECURRENT),
    ]
    a = spec.attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.scaling) == (32, 32, 192, 0, 192**-0.5)
    assert a.latent is not None and (a.latent.kv_lora_rank, a.latent.qk_rope_head_dim, a.latent.v_head_dim) == (512, 64, 128)
    cfg = spec.config
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["n_group"], cfg["n_shared_experts"], cfg["norm_topk_prob"]) == (
        256,
        8,
        1,
        1,
        True,
    )
    written = {k: v for k, v in hub.items() if k != "linear_attn_config"}
    written.update(
        layer_types=["full_attention" if k == A else "linear_attention" for (k,) in spec.layer_mixers],
        linear_num_heads=32,
        linear_head_dim=128,
        linear_conv_kernel_dim=4,
    )
    assert parse_model_spec(written) == spec


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (dict(mla_use_nope=False), "mla_use_nope=False is not supported"),
        (dict(num_key_value_heads=8), "num_key_value_heads=8 is not supported"),
        (dict(moe_router_activation_func="softmax"), "moe_router_activation_func='softmax' is not supported"),
        (dict(attention_bias=True), "attention_bias=True is not supported"),
        (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
        (dict(num_expert_group=3), "num_experts 256 in n_group 3"),
        (dict(kv_lora_rank=None), "kv_lora_rank"),
        (dict(mlp_layer_types=["dense"] * 3), "mlp_layer_types must give"),
        (dict(linear_attn_config=dict(config("kimi-linear-48b-a3b")["linear_attn_config"], kda_layers=[1, 2])), "name each of the 27 layers once"),
    ],
)
def test_a_kimi_linear_config_it_cannot_serve_is_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        parse_model_spec(dict(config("kimi-linear-48b-a3b"), **fields))


def test_old_and_new_layer_type_spellings_are_the_same_model():
    old = config("granite-4.0-h-tiny")
    new = dict(old, layer_types=["linear_attention" if t == "mamba" else "full_attention" for t in old["layer_types"]])
    assert parse_model_spec(old).layer_mixers == parse_model_spec(new).layer_mixers
    pattern = config("nemotron-3-nano-30b-a3b")
    listed = dict(pattern)
    del listed["hybrid_override_pattern"]
    names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    listed["layers_block_type"] = [names[c] for c in pattern["hybrid_override_pattern"]]
    assert parse_model_spec(pattern).layer_mixers == parse_model_spec(listed).layer_mixers


@pytest.mark.parametrize(
    "name,field",
    [
        ("granite-4.0-h-tiny", "mamba_d_state"),
        ("granite-4.0-h-tiny", "mamba_n_heads"),
        ("nemotron-3-nano-30b-a3b", "ssm_state_size"),
        ("mamba-codestral-7b", "head_dim"),
        ("mamba-codestral-7b", "conv_kernel"),
        ("falcon-h1-7b-instruct", "mamba_d_ssm"),
        ("falcon-h1-7b-instruct", "mamba_d_state"),
        ("falcon-h1-7b-instruct", "mamba_d_conv"),
    ],
)
def test_a_recurrent_layer_missing_a_dimension_is_refused_naming_the_field(name, field):
    missing = config(name)
    del missing[field]
    with pytest.raises(ConfigError, match=field):
        parse_model_spec(missing)
    zero = dict(config(name), **{field: 0})
    with pytest.raises(ConfigError, match=field):
        parse_model_spec(zero)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(mamba_d_head=100), r"mamba_n_heads \* mamba_d_head \(2400\) != the Mamba width mamba_d_ssm \(3072\)"),
        (dict(mamba_d_ssm=None), r"mamba_n_heads \* mamba_d_head \(3072\) != the Mamba width mamba_d_ssm \(6144\)"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn' is not supported"),
        (dict(mamba_n_groups=5), r"mamba heads \(24\) not divisible by n_groups \(5\)"),
    ],
)
def test_a_falcon_h1_config_transformers_would_read_otherwise_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        parse_model_spec(dict(config("falcon-h1-7b-instruct"), **fields))


def test_falcon_h1_gate_norm_follows_its_flags():
    read = [
        parse_model_spec(dict(config("falcon-h1-7b-instruct"), mamba_rms_norm=norm, mamba_norm_before_gate=before)).mamba.gate_norm
        for norm, before in ((False, True), (True, True), (True, False))
    ]
    assert read == [GateNorm.NONE, GateNorm.BEFORE_GATE, GateNorm.AFTER_GATE]


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
    again = llm.generate(
        {"prompt_token_ids": llm.get_tokenizer().encode("Hello", add_special_tokens=False)},
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
    )
    assert again[0].token_ids == outs[0].token_ids
