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
