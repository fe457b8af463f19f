"""The engine's side of vLLM's request fields: prompt logprobs and embeddings (the last hidden
state at every prompt position, compared with transformers), min_tokens, allowed_token_ids and
bad_words (masks applied before sampling)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import greedy, make_engine, random_prompt, run_to_end

from engram.engine.request import SamplingParams

KINDS = ("granite", "mamba2", "bamba")


def hf_forward(hf_model, prompt: list[int]):
    with torch.no_grad():
        return hf_model(torch.tensor([prompt]), output_hidden_states=True)


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logprobs_match_transformers_across_chunks(kind, checkpoint_dir, hf_model, monkeypatch):
    monkeypatch.setattr("engram.engine.engine.PROMPT_LOGITS_ROWS", 7)  # the logits of a 16-token chunk in three slices
    path = checkpoint_dir(kind)
    engine = make_engine(path, max_num_batched_tokens=16)  # a 40-token prompt in three chunks
    prompt, other = random_prompt(40, seed=1), random_prompt(9, seed=2)
    engine.add_request("other", other, greedy(3))  # batched with a request that asks for none
    engine.add_request("p", prompt, greedy(2, prompt_logprobs=3))
    done = run_to_end(engine)
    ref = torch.log_softmax(hf_forward(hf_model(path), prompt).logits[0].float(), -1)
    got = done["p"].prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    for i, entry in enumerate(got[1:], start=1):
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        values, ids = ref[i - 1].topk(3)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    assert done["other"].prompt_logprobs is None
    # the sampled tokens are those of a request without prompt logprobs
    plain = make_engine(path)
    plain.add_request("q", prompt, greedy(2))
    assert run_to_end(plain)["q"].token_ids == done["p"].token_ids


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_is_the_mean_last_hidden_state(kind, checkpoint_dir, hf_model):
    path = checkpoint_dir(kind)
    engine = make_engine(path, max_num_batched_tokens=16)
    prompt = random_prompt(37, seed=3)
    engine.add_request("e", prompt, SamplingParams(max_tokens=0), embed=True)
    engine.add_request("g", random_prompt(5, seed=4), greedy(4))
    done = run_to_end(engine)
    ref = hf_forward(hf_model(path), prompt).hidden_states[-1][0].float().mean(0)
    got = torch.tensor(done["e"].embedding)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert done["e"].token_ids == [] and done["g"].embedding is None


def test_prompt_rows_need_the_whole_prompt_computed(checkpoint_dir):
    engine = make_engine(checkpoint_dir("granite"))
    prompt = random_prompt(12, seed=5)
    engine.add_request("s", prompt[:8], SamplingParams(max_tokens=1, temperature=0), capture_state=True)
    state = run_to_end(engine)["s"].state
    with pytest.raises(ValueError, match="prompt_logprobs needs every prompt token computed"):
        engine.add_request("p", prompt, greedy(1, prompt_logprobs=0), initial_state=state)


def first_logits(hf_model, path, prompt) -> torch.Tensor:
    return hf_forward(hf_model(path), prompt).logits[0, -1].float()


def test_min_tokens_masks_stop_tokens_and_strings(checkpoint_dir, hf_model):
    path = checkpoint_dir("granite")
    engine = make_engine(path)
    prompt = random_prompt(10, seed=6)
    engine.add_request("free", prompt, greedy(6))
    stop_id = run_to_end(engine)["free"].token_ids[0]
    engine.add_request("stops", prompt, greedy(6, stop_token_ids=[stop_id]))
    engine.add_request("min", prompt, greedy(6, stop_token_ids=[stop_id], min_tokens=4))
    done = run_to_end(engine)
    assert done["stops"].token_ids == [stop_id]
    out = done["min"].token_ids
    assert stop_id not in out[:4] and len(out) >= 4
    logits = first_logits(hf_model, path, prompt)
    logits[stop_id] = -torch.inf
    assert out[0] == int(logits.argmax())  # the best token but the masked one


def test_min_tokens_defers_stop_strings(checkpoint_dir):
    engine = make_engine(checkpoint_dir("granite"))
    prompt = random_prompt(10, seed=7)
    engine.add_request("free", prompt, greedy(6))
    free = run_to_end(engine)["free"]
    stop = free.text[:1]
    engine.add_request("stop", prompt, greedy(6, stop=[stop]))
    engine.add_request("min", prompt, greedy(6, stop=[stop], min_tokens=6))
    done = run_to_end(engine)
    assert done["stop"].text == "" and done["stop"].finish_reason.value == "stop"
    assert done["min"].token_ids == free.token_ids and done["min"].finish_reason.value == "length"


def test_allowed_token_ids(checkpoint_dir, hf_model):
    path = checkpoint_dir("granite")
    engine = make_engine(path)
    prompt = random_prompt(10, seed=8)
    allowed = [70, 71, 72, 200]
    engine.add_request("a", prompt, greedy(8, allowed_token_ids=allowed))
    engine.add_request("s", prompt, SamplingParams(max_tokens=8, allowed_token_ids=allowed, seed=3, ignore_eos=True))
    done = run_to_end(engine)
    assert set(done["a"].token_ids) <= set(allowed) and set(done["s"].token_ids) <= set(allowed)
    logits = first_logits(hf_model, path, prompt)
    assert done["a"].token_ids[0] == allowed[int(logits[allowed].argmax())]
    with pytest.raises(ValueError, match="allowed_token_ids outside the vocabulary"):
        engine.add_request("bad", prompt, greedy(1, allowed_token_ids=[10**6]))


def test_bad_words_never_appear(checkpoint_dir):
    engine = make_engine(checkpoint_dir("granite"))
    prompt = random_prompt(10, seed=9)
    engine.add_request("free", prompt, greedy(12))
    free = run_to_end(engine)["free"]
    word = free.text[2:4]  # two bytes the model writes: a two-token word of the byte tokenizer
    assert len(word) == 2 and word.strip() == word
    engine.add_request("b", prompt, greedy(12, bad_words=[word]))
    out = run_to_end(engine)["b"]
    assert word not in out.text and out.token_ids[:2] == free.token_ids[:2]
