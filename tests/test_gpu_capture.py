"""Captured states are copied to host memory on a side stream while the engine goes on (CUDA).

The copy must not race with the engine reusing the slot and pages it reads, and a restore from a
copy still in flight must wait for it. CPU CI skips this file; run it on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from engine_utils import greedy, make_engine, random_prompt, run_to_end

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (side-stream copies)")


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return make_engine(checkpoint_dir("nemotron"), device="cuda", dtype="float32", max_running_requests=2)


def test_capture_is_not_overwritten_by_the_next_request_in_its_slot(engine):
    prompt = random_prompt(300, seed=1)
    engine.add_request("a", prompt, greedy(4), capture_state=True)
    captured = run_to_end(engine)["a"].state
    engine.add_request("b", random_prompt(300, seed=2), greedy(40))  # reuses the freed slot and pages at once
    run_to_end(engine)
    torch.cuda.synchronize()
    engine.add_request("again", prompt, greedy(4), capture_state=True)
    reference = run_to_end(engine)["again"].state.wait()
    captured.wait()
    for name, tensor in reference.tensors.items():
        torch.testing.assert_close(captured.tensors[name], tensor, atol=1e-5, rtol=1e-5)


def test_resume_from_a_capture_still_in_flight_is_exact(engine):
    prompt = random_prompt(200, seed=3)
    new = random_prompt(20, seed=4)
    engine.add_request("head", prompt, greedy(6), capture_state=True, retain_key="k")
    head = run_to_end(engine)["head"]
    history = head.prompt_token_ids + head.token_ids
    engine.add_request("warm", history + new, greedy(8), initial_state=head.state)  # no wait() on purpose
    warm = run_to_end(engine)["warm"].token_ids
    engine.add_request("active", history + new, greedy(8), initial_state=head.state, resume_key="k")
    active = run_to_end(engine)["active"].token_ids
    engine.add_request("full", history + new, greedy(8))
    assert warm == active == run_to_end(engine)["full"].token_ids


def test_an_incremental_capture_in_flight_shares_its_base_and_equals_a_full_prefill(engine):
    head_prompt = random_prompt(250, seed=5)
    engine.add_request("head", head_prompt, greedy(4), capture_state=True, retain_key="h")
    head = run_to_end(engine)["head"].state  # still copying: the next capture's base is in flight too
    prompt = head.tokens + random_prompt(30, seed=6)
    before = engine.stats().capture_bytes_total
    engine.add_request("next", prompt, greedy(4), capture_state=True, resume_key="h", host_base=head)
    state = run_to_end(engine)["next"].state
    copied = engine.stats().capture_bytes_total - before
    engine.add_request("full", prompt, greedy(4), capture_state=True)
    reference = run_to_end(engine)["full"].state.wait()
    state.wait()
    assert (reference.tokens, reference.state_len) == (state.tokens, state.state_len)
    assert [(s.start, s.end) for s in state.kv_segments] == [(0, head.state_len), (head.state_len, state.state_len)]
    assert all(t.is_pinned() for segment in state.kv_segments for t in segment.tensors.values())
    kv_per_token = sum(t[0].numel() * t.element_size() for t in state.kv_segments[1].tensors.values())
    assert copied == (state.state_len - head.state_len) * kv_per_token + sum(t.numel() * t.element_size() for t in state.tensors.values())
    for name in reference.kv_names:
        torch.testing.assert_close(state.kv_rows(name, 0, state.state_len), reference.tensors[name], atol=1e-5, rtol=1e-5)
    for name, tensor in state.tensors.items():
        torch.testing.assert_close(tensor, reference.tensors[name], atol=1e-4, rtol=1e-4)
