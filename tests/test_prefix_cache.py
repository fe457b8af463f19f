"""The prefix cache: a request that begins with an earlier request's prompt restores that prompt's
state (captured by the engine at the end of its prefill) and computes only the rest, exactly."""

from __future__ import annotations

import httpx
import pytest
import torch
from engine_utils import greedy, make_engine, random_prompt, run_to_end
from server_utils import metric_value, running_server
from test_conversations import full_generation

from engram.state.chunks import PrefixHasher
from engram.state.eviction import ComputeSavedPolicy, PrefillCost
from engram.state.prefix_cache import PrefixCache
from engram.state.sequence_state import SequenceState

MODEL = "m"


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return make_engine(checkpoint_dir("nemotron"))


def test_the_prompt_state_continues_as_a_full_prefill_does(engine):
    prompt = random_prompt(45, 1)
    engine.add_request("a", prompt, greedy(5), capture_prompt_state=True)
    out = run_to_end(engine)["a"]
    state = out.prompt_state
    assert state.tokens == prompt and state.state_len == len(prompt) and out.state is None
    longer = prompt + out.token_ids + random_prompt(7, 2)
    engine.add_request("b", longer, greedy(6), initial_state=state)
    resumed = run_to_end(engine)["b"]
    assert resumed.num_cached_tokens == len(prompt)
    assert resumed.token_ids == full_generation(engine, longer, 6)
    # The comparison can fail: the state of another prompt of this length, passed off as this one's.
    engine.add_request("other", random_prompt(45, 3), greedy(1), capture_prompt_state=True)
    other = run_to_end(engine)["other"].prompt_state
    engine.add_request("c", longer, greedy(6), initial_state=SequenceState(prompt, len(prompt), other.tensors))
    assert run_to_end(engine)["c"].token_ids != resumed.token_ids


def _state(tokens: list[int], nbytes: int = 16) -> SequenceState:
    return SequenceState(tokens, len(tokens), {"x": torch.zeros(nbytes, dtype=torch.uint8)})


def _cache_of(*states: SequenceState) -> PrefixCache:
    cache = PrefixCache(PrefixHasher(b"id", 4), max_bytes=1 << 20)
    for s in states:
        cache.admit(s)
    return cache


def test_lookup_finds_the_longest_stored_prefix_that_leaves_a_token_to_compute():
    base = list(range(10))
    short, long = _state(base[:3]), _state(base[:9])
    cache = _cache_of(short, long)
    assert cache.lookup(base + [99]) is long
    assert cache.lookup(base[:9]) is short  # all nine would leave nothing to compute
    assert cache.lookup(base[:5] + [7, 7, 7, 7, 7]) is short
    assert cache.lookup([1] + base) is None
    assert cache.stats.hits == 3 and cache.stats.tokens_reused == 9 + 3 + 3
    assert cache.lookup([-(1 << 60), *base]) is None  # not token ids: the engine refuses them
    assert cache.lookup([*base[:5], 1 << 40, 0]) is short  # the engine refuses what follows the restored prefix


def test_a_state_no_longer_than_the_engines_slot_gives_way_to_a_shorter_one():
    base = list(range(10))
    short, long = _state(base[:3]), _state(base[:6])
    cache = _cache_of(short, long)
    assert cache.lookup(base, on_device=5) is long  # longer than the slot: worth its copy
    assert cache.lookup(base, on_device=6) is short  # the slot wins; a shorter state is the captures' base
    assert cache.lookup(base, on_device=9) is long  # shorter than the slot: the base
    assert cache.lookup(base, on_device=3) is long and cache.lookup(base[:4] + [0], on_device=3) is None


def test_prompts_shorter_than_the_minimum_are_not_kept():
    cache = PrefixCache(PrefixHasher(b"id", 4), max_bytes=1 << 20, min_tokens=8)
    cache.admit(_state(list(range(7))))
    assert len(cache) == 0 and not cache.wants(7) and cache.wants(8)
    cache.admit(_state(list(range(8))))
    assert cache.lookup(list(range(9))) is not None


def test_the_least_recently_used_states_leave_first_under_the_budget():
    cache = PrefixCache(PrefixHasher(b"id", 4), max_bytes=40)
    a, b, c = (_state([i] * 6) for i in range(3))
    cache.admit(a)
    cache.admit(b)
    assert cache.lookup([0] * 7) is a  # a is now the most recently used
    cache.admit(c)
    assert len(cache) == 2 and cache.nbytes == 32
    assert cache.lookup([1] * 7) is None and cache.lookup([0] * 7) is a and cache.lookup([2] * 7) is c


def _resend_history_dialogue(srv, turns: int = 3, messages: list[dict] | None = None) -> tuple[list[str], list[int], list[int], list[float]]:
    """A client that sends its whole history every turn: replies, cached and prompt tokens per turn,
    and the logprobs of every reply token.
    `messages`: a dialogue to continue (extended in place). Replies are of ASCII letters, so that the
    next turn's prompt holds them as the tokens that were generated (a random model's bytes may
    not be UTF-8, and their text encodes to other tokens)."""
    if messages is None:
        messages = []
    if not messages:
        messages.append({"role": "system", "content": "You are terse. " * 20})
    replies, cached, prompts, logprobs = [], [], [], []
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        letters = http.post("/tokenize", json={"model": MODEL, "prompt": "abcdefghijklmnop", "add_special_tokens": False}).json()["tokens"]
        for i in range(len(messages) // 2, len(messages) // 2 + turns):
            messages.append({"role": "user", "content": f"question {i}: " + "why " * (5 + i)})
            body = {
                "model": MODEL,
                "messages": messages,
                "temperature": 0,
                "max_tokens": 8,
                "ignore_eos": True,
                "allowed_token_ids": letters,
                "logprobs": True,
            }
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            reply, usage = r.json()["choices"][0]["message"]["content"], r.json()["usage"]
            messages.append({"role": "assistant", "content": reply})
            replies.append(reply)
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            prompts.append(usage["prompt_tokens"])
            logprobs += [t["logprob"] for t in r.json()["choices"][0]["logprobs"]["content"]]
    return replies, cached, prompts, logprobs


def test_a_client_that_resends_its_history_restores_its_previous_prompt(checkpoint_dir, tmp_path):
    path = checkpoint_dir("nemotron")
    with running_server(path, MODEL, snapshot_dir=str(tmp_path / "on"), enable_prefix_caching=True, prefix_cache_min_tokens=1) as srv:
        replies, cached, prompts, logprobs = _resend_history_dialogue(srv)
        page = httpx.get(srv.url + "/metrics").text
        slot_hits = metric_value(page, "engram:prefix_cache_slot_hits_total", model_name=MODEL)
        # the last turn's slot is kept, and counts as free: nothing runs
        assert (
            metric_value(page, "engram:prefix_cache_slots", model_name=MODEL) == 1
            and metric_value(page, "engram:kv_blocks_retained", model_name=MODEL) > 0
        )
        assert metric_value(page, "engram:kv_pool_usage", model_name=MODEL) == metric_value(page, "engram:state_pool_usage", model_name=MODEL) == 0
        assert len(srv.app.state.serving.conversations.manager.prefix_cache) > 0
        assert httpx.post(srv.url + "/flush_cache").json()["success"]  # SGLang's flush empties the cache
        assert len(srv.app.state.serving.conversations.manager.prefix_cache) == 0
        assert "engram:prefix_cache_disk_hits_total" in httpx.get(srv.url + "/metrics").text
    with running_server(
        path, MODEL, snapshot_dir=str(tmp_path / "short"), enable_prefix_caching=True, prefix_cache_min_tokens=prompts[-1] + 1
    ) as srv:  # every prompt too short to be worth a capture
        assert _resend_history_dialogue(srv)[1] == [0, 0, 0]
        assert len(srv.app.state.serving.conversations.manager.prefix_cache) == 0
    with running_server(path, MODEL, snapshot_dir=str(tmp_path / "off"), enable_prefix_caching=False) as srv:
        without = _resend_history_dialogue(srv)
    # turn 2 onwards adopts the previous turn's slot (the GPU tier): its prompt and all but its last reply token
    assert slot_hits == 2 and cached[0] == 0 and all(cached[i] == prompts[i - 1] + 7 for i in range(1, len(cached))), (cached, prompts)
    assert without[1] == [0, 0, 0]
    assert replies == without[0] and prompts == without[2]
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(without[3]), atol=1e-4), (logprobs, without[3])  # float32: the same computation


def test_eviction_keeps_the_state_that_saves_more_compute_where_lru_would_not():
    long, short, medium = _state(list(range(12))), _state([50, 51, 52]), _state([60, 61, 62, 63, 64, 65])
    kept = {}
    for name, policy in (("compute", ComputeSavedPolicy()), ("lru", ComputeSavedPolicy(alpha=0.0))):  # alpha 0: recency alone
        cache = PrefixCache(PrefixHasher(b"id", 4), max_bytes=40, policy=policy)  # room for two
        for s in (long, short, medium):  # the long prefix is the least recently used when the third arrives
            cache.admit(s)
        kept[name] = {s.state_len for s in (long, short, medium) if cache.lookup(s.tokens + [1]) is s}
    assert kept == {"compute": {12, 6}, "lru": {3, 6}}


def test_a_longer_prefix_saves_more_compute_per_byte_on_a_hybrid_model(checkpoint_dir):
    from engram.models.spec import load_model_spec

    spec = load_model_spec(checkpoint_dir("nemotron"))
    cost = PrefillCost.of(spec)
    assert spec.is_hybrid and cost.per_token > 0 and cost.per_pair > 0
    assert cost.flops(2000) > 2 * cost.flops(1000)  # attention's quadratic term
