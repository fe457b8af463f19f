"""Overlapped scheduling: a greedy step's tokens stay on the device while the next step runs.

Outputs must not change, and a sequence found stopped one step late keeps an exact state (one
that covers its last token too)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import greedy, make_engine, random_prompt, record_logits, run_to_end

from engram.engine.request import FinishReason, SamplingParams


def _count_overlapped_steps(engine) -> list[int]:
    """How many runner calls fed at least one token that was still in flight."""
    count = [0]
    run = engine.runner.run

    def counting(chunks):
        count[0] += any(c.seq.num_inflight for c in chunks)
        return run(chunks)

    engine.runner.run = counting
    return count


def _mixed_workload(engine, base_tokens: list[int], base_text: str) -> dict:
    prompt = random_prompt(12, seed=7)
    engine.add_request("long", prompt, greedy(24))
    engine.add_request("short", random_prompt(5, seed=8), greedy(3))
    engine.add_request("tok", prompt, greedy(24, stop_token_ids=[base_tokens[6]]))
    engine.add_request("str", prompt, greedy(24, stop=[base_text[len(base_text) // 2 :][:2]]))
    engine.add_request("sampled", random_prompt(9, seed=9), SamplingParams(max_tokens=10, temperature=0.8, seed=3))
    finished = {}
    for _ in range(4):
        for out in engine.step():
            finished[out.request_id] = out
    engine.add_request("late", random_prompt(20, seed=10), greedy(8))  # admitted while tokens are in flight
    finished.update(run_to_end(engine))
    return {r: (o.token_ids, o.text, o.finish_reason, o.stop_reason) for r, o in finished.items() if o.finished}


@pytest.mark.parametrize("kind", ["mamba2", "nemotron"])
def test_overlapped_steps_give_the_same_outputs(kind, checkpoint_dir):
    path = checkpoint_dir(kind)
    engine = make_engine(path, enable_overlap_schedule=False)
    engine.add_request("base", random_prompt(12, seed=7), greedy(24))
    base = run_to_end(engine)["base"]
    assert base.text  # the stop string below is cut from it

    plain = make_engine(path, enable_overlap_schedule=False)
    plain_count = _count_overlapped_steps(plain)
    expected = _mixed_workload(plain, base.token_ids, base.text)
    overlapped = make_engine(path, enable_overlap_schedule=True)
    overlapped_count = _count_overlapped_steps(overlapped)
    got = _mixed_workload(overlapped, base.token_ids, base.text)

    assert got == expected
    assert expected["tok"][2] == FinishReason.STOP and expected["str"][2] == FinishReason.STOP
    assert plain_count[0] == 0 and overlapped_count[0] > 10
    for engine in (plain, overlapped):
        stats = engine.stats()
        assert (stats.num_running, stats.state_slots_used, stats.kv_blocks_used) == (0, 0, 0)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_stop_seen_one_step_late_leaves_an_exact_state(overlap, checkpoint_dir):
    path = checkpoint_dir("nemotron")
    prompt = random_prompt(15, seed=11)
    engine = make_engine(path, enable_overlap_schedule=overlap)
    engine.add_request("base", prompt, greedy(12))
    base = run_to_end(engine)["base"]
    stop = base.token_ids[4]
    engine.add_request("turn", prompt, greedy(12, stop_token_ids=[stop]), capture_state=True)
    turn = run_to_end(engine)["turn"]
    assert turn.token_ids == base.token_ids[: base.token_ids.index(stop) + 1]
    history = prompt + turn.token_ids
    state = turn.state
    assert state.tokens == history
    # Overlapped, the stop token was fed before the stop was seen: the state covers it as well.
    assert state.state_len == (len(history) if overlap else len(history) - 1)

    follow_up = history + random_prompt(6, seed=12)
    logits = record_logits(engine)
    engine.add_request("resumed", follow_up, greedy(8), initial_state=state)
    resumed = run_to_end(engine)["resumed"]
    fresh = make_engine(path, enable_overlap_schedule=False)
    fresh_logits = record_logits(fresh)
    fresh.add_request("full", follow_up, greedy(8))
    full = run_to_end(fresh)["full"]
    assert resumed.num_cached_tokens == state.state_len
    assert resumed.token_ids == full.token_ids
    torch.testing.assert_close(logits[0][0], fresh_logits[0][0], atol=1e-4, rtol=1e-4)


def test_unseeded_sampling_overlaps_and_seeded_sampling_does_not(checkpoint_dir):
    path = checkpoint_dir("mamba2")
    prompt = random_prompt(10, seed=13)
    results = []
    for overlap in (False, True):
        engine = make_engine(path, enable_overlap_schedule=overlap)
        count = _count_overlapped_steps(engine)
        engine.add_request("seeded", prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True))
        seeded = run_to_end(engine)["seeded"].token_ids
        overlapped_seeded = count[0]
        engine.add_request("free", prompt, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
        free = run_to_end(engine)["free"].token_ids
        results.append((seeded, overlapped_seeded, free, count[0] - overlapped_seeded))
    (seeded_plain, _, free_plain, n_plain), (seeded_over, n_seeded_over, free_over, n_free_over) = results
    # A request with its own seed draws from its own generator on the host, one step at a time.
    assert seeded_over == seeded_plain and n_seeded_over == 0
    # Without a seed it draws on the device from the engine's generator: the same draws either way.
    assert free_over == free_plain and n_plain == 0 and n_free_over >= 10
