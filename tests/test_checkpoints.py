from __future__ import annotations

import json

import pytest
import torch
from checkpoints import KINDS, write_checkpoint

from engram.models.spec import LayerKind, load_model_spec

M, A, P, E, G, S, K = (
    LayerKind.MAMBA,
    LayerKind.ATTENTION,
    LayerKind.MLP,
    LayerKind.MOE,
    LayerKind.GATED_DELTANET,
    LayerKind.SHORT_CONV,
    LayerKind.KDA,
)
LAYOUTS = {  # each layer's mixers
    "mamba2": ((M,), (M,), (M,)),
    "mamba2_tied": ((M,), (M,), (M,)),
    "granite": ((M,), (A,), (M,), (A,)),
    "granite_rope": ((M,), (A,), (M,), (A,)),
    "nemotron": ((M,), (A,), (M,), (P,), (E,), (A,)),
    "bamba": ((M,), (A,), (M,), (A,)),
    "falcon_h1": ((M, A),) * 3,
    "falcon_h1_tied": ((M, A),) * 3,
    "qwen3_next": ((G,), (A,), (G,), (A,)),
    "qwen3_5": ((G,), (A,), (G,), (A,)),
    "qwen3_5_moe": ((G,), (G,), (A,), (G,)),
    "lfm2": ((S,), (A,), (S,), (S,)),
    "kimi_linear": ((K,), (A,), (K,), (K,)),
    "kimi_linear_qlora": ((A,), (K,), (K,)),
}
TIED = {"mamba2_tied", "granite", "granite_rope", "falcon_h1_tied", "qwen3_5", "lfm2"}


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    return request.param, write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_kinds_cover_layouts():
    assert set(KINDS) == set(LAYOUTS)


def test_checkpoint_loads_and_is_decisive(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kind, path = checkpoint
    spec = load_model_spec(path)
    assert spec.layer_mixers == LAYOUTS[kind]
    assert spec.tie_word_embeddings == (kind in TIED)
    if spec.mamba is not None:
        assert spec.mamba.n_groups == 2 and spec.mamba.chunk_size == 8
    elif spec.short_conv is not None:  # a conv window of L_cache - 1 inputs over the hidden width
        assert spec.mixer_state_tensors(S)[0].shape == (2, spec.hidden_size)
    elif spec.kda is not None:  # Kimi Delta Attention: a conv window over q, k and v, a state per head
        assert [t.shape for t in spec.mixer_state_tensors(K)] == [(2, 3 * 3 * 8), (3, 8, 8)]
    else:  # gated DeltaNet: value heads grouped over q/k heads in all but one
        assert spec.gated_deltanet is not None and (spec.gated_deltanet.num_v_heads > spec.gated_deltanet.num_k_heads) == (kind != "qwen3_5")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert spec.vocab_size >= len(tokenizer)
    assert spec.eos_token_ids == (tokenizer.eos_token_id,)
    if spec.attention is not None:
        # latent attention expands K and V to every head
        assert spec.attention.num_kv_heads < spec.attention.num_heads or kind == "qwen3_5_moe" or spec.attention.latent is not None

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    model.generation_config.eos_token_id = None  # always decode all the steps
    prompt = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=40, do_sample=False, output_logits=True, return_dict_in_generate=True)
        recomputed = model(out.sequences).logits[0, prompt.shape[1] - 1 : -1]
    tokens = out.sequences[0, prompt.shape[1] :].tolist()
    step_logits = torch.cat(out.logits)
    top2 = step_logits.topk(2).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    assert len(set(tokens)) >= 10, tokens  # not a constant repeat or a short loop
    assert sum(g > 1e-3 for g in gaps) >= 36, gaps
    # Decisive: the cached decode path and a full recomputation pick the same tokens.
    assert recomputed.argmax(-1).tolist() == tokens
    torch.testing.assert_close(recomputed, step_logits, atol=1e-4, rtol=1e-4)


def test_seed_and_overrides(tmp_path):
    a = write_checkpoint("bamba", tmp_path / "a", seed=3, num_hidden_layers=2, attn_layer_indices=[1])
    b = write_checkpoint("bamba", tmp_path / "b", seed=3, num_hidden_layers=2, attn_layer_indices=[1])
    c = write_checkpoint("bamba", tmp_path / "c", seed=4, num_hidden_layers=2, attn_layer_indices=[1])
    assert json.loads((a / "config.json").read_text())["num_hidden_layers"] == 2
    assert load_model_spec(a).layer_mixers == ((M,), (A,))
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
