"""Incremental capture at turn end: a turn copies from the device only the KV the host lacks, its
state shares the earlier turn's host KV, and every consumer of a segmented state stays exact."""

from __future__ import annotations

import pytest
import torch
from engine_utils import greedy, make_engine, manager_of, random_prompt, run_to_end

from engram.state.chunks import ChunkStore, PrefixHasher
from engram.state.conversations import TierConfig, retain_key
from engram.state.sequence_state import KVSegment, SequenceState, check_state, recurrent_tensors
from engram.state.store import WarmCache


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return make_engine(checkpoint_dir("nemotron"), max_running_requests=4)


@pytest.fixture(autouse=True)
def no_retained_slots(engine):
    yield
    for key in list(engine.scheduler.retained):
        engine.release_retained(key)


def kv_bytes_per_token(engine) -> int:
    a = engine.spec.attention
    return 2 * len(engine.spec.attention_layers) * a.num_kv_heads * a.head_dim * engine.state_dtypes.kv.itemsize


def recurrent_bytes(engine) -> int:
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in recurrent_tensors(engine.spec, engine.state_dtypes).values())


def run(engine, prompt, max_tokens=5, **kwargs):
    """The request's output and the bytes its capture copied device to host."""
    before = engine.stats().capture_bytes_total
    engine.add_request("r", prompt, greedy(max_tokens), capture_state=True, **kwargs)
    out = run_to_end(engine)["r"]
    return out, engine.stats().capture_bytes_total - before


def full(engine, prompt, max_tokens=5):
    """The reference: one prefill of the whole prompt, its state captured whole."""
    engine.add_request("full", prompt, greedy(max_tokens), capture_state=True)
    return run_to_end(engine)["full"]


def block(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def assert_same_kv(state: SequenceState, reference: SequenceState, upto: int) -> None:
    assert sorted(state.kv_names) == sorted(reference.kv_names)
    for name in reference.kv_names:
        torch.testing.assert_close(state.kv_rows(name, 0, upto), reference.kv_rows(name, 0, upto), rtol=1e-5, atol=1e-5)


def test_a_three_turn_conversation_copies_only_its_new_tokens(engine, tmp_path):
    manager = manager_of(engine, tmp_path, tiers=TierConfig(active_timeout=10, warm_timeout=100))
    per_token, fixed = kv_bytes_per_token(engine), recurrent_bytes(engine)
    states: list[SequenceState] = []
    for i, new in enumerate((random_prompt(40, 1), random_prompt(9, 2), random_prompt(7, 3))):
        plan = manager.begin("c")
        assert plan.state_tier == ("active" if i else None) and (plan.host_base is not None) == (i > 0)
        prompt = plan.history_tokens + new
        out, nbytes = run(
            engine, prompt, initial_state=plan.state, resume_key=plan.resume_key, host_base=plan.host_base, retain_key=retain_key("c", plan.ref)
        )
        manager.finish(plan, prompt, out.token_ids, [{"role": "user", "content": "x"}], out.state)
        reference = full(engine, prompt)
        assert out.token_ids == reference.token_ids  # the resumed turn equals one full prefill
        assert_same_kv(out.state, reference.state, out.state.state_len)
        fresh = out.state.state_len - (states[-1].state_len if states else 0)
        assert nbytes <= fresh * per_token + fixed, (i, nbytes, fresh)
        if i:  # a whole capture would copy the history's KV again
            assert nbytes < out.state.state_len * per_token + fixed
        states.append(out.state)

    first, second, third = states
    assert [(s.start, s.end) for s in third.kv_segments] == [
        (0, first.state_len),
        (first.state_len, second.state_len),
        (second.state_len, third.state_len),
    ]
    name = third.kv_names[0]
    assert block(third.kv_segments[0].tensors[name]) == block(first.tensors[name])  # turn 1's host KV, not a copy
    assert block(third.kv_segments[1].tensors[name]) == block(second.kv_segments[1].tensors[name])
    assert manager.warm.nbytes < sum(s.nbytes for s in states)  # the shared KV counted once


def test_a_restored_state_is_the_base_of_the_next_capture_and_restores_exactly(engine):
    history = random_prompt(30, 4)
    first, _ = run(engine, history)
    prompt = first.state.tokens + random_prompt(6, 5)
    second, nbytes = run(engine, prompt, initial_state=first.state)  # a warm or cold restore: no slot adopted
    assert nbytes <= (second.state.state_len - first.state.state_len) * kv_bytes_per_token(engine) + recurrent_bytes(engine)
    assert second.token_ids == full(engine, prompt).token_ids
    check_state(engine.spec, engine.state_dtypes, second.state)
    # The segmented state restores exactly (KVPool.write per segment) and is itself a base.
    third_prompt = second.state.tokens + random_prompt(4, 6)
    third, _ = run(engine, third_prompt, initial_state=second.state)
    assert third.token_ids == full(engine, third_prompt).token_ids
    assert len(third.state.kv_segments) == 3


def test_a_fork_shares_the_host_kv_of_the_turn_it_starts_from(engine):
    base, _ = run(engine, random_prompt(24, 7))
    branches = [run(engine, base.state.tokens + random_prompt(3, seed), initial_state=base.state)[0] for seed in (8, 9)]
    name = base.state.kv_names[0]
    for out in branches:
        assert block(out.state.kv_segments[0].tensors[name]) == block(base.state.tensors[name])
        assert out.token_ids == full(engine, out.state.tokens[: len(base.state.tokens) + 3]).token_ids


def test_the_prompt_state_of_a_prefix_hit_shares_the_entry_it_extends(engine):
    prefix, _ = run(engine, random_prompt(20, 10), max_tokens=1)
    n = prefix.state.state_len
    prompt = prefix.state.tokens[:n] + random_prompt(8, 11)
    engine.add_request("p", prompt, greedy(2), initial_state=prefix.state, capture_prompt_state=True)
    state = run_to_end(engine)["p"].prompt_state
    assert [(s.start, s.end) for s in state.kv_segments] == [(0, n), (n, len(prompt))]
    reference = full(engine, prompt, max_tokens=1).state
    assert_same_kv(state, reference, len(prompt))
    for name in state.recurrent:
        torch.testing.assert_close(state.tensors[name], reference.tensors[name], rtol=1e-5, atol=1e-5)


def test_a_host_base_that_is_not_the_prompts_prefix_is_refused(engine):
    base, _ = run(engine, random_prompt(10, 12), retain_key="k")
    other = random_prompt(12, 13)
    with pytest.raises(ValueError, match="host_base: the state's tokens are not a prefix"):
        engine.add_request("bad", base.state.tokens + [1], greedy(1), resume_key="k", host_base=SequenceState(other, 12, base.state.tensors))


def segmented(state: SequenceState, cut: int) -> SequenceState:
    """The same state with its KV held as two segments (views), as a turn's capture holds it."""
    return SequenceState(state.tokens, state.state_len, state.recurrent, kv_segments=tuple(state.kv_pieces(0, cut) + state.kv_pieces(cut)))


def test_the_chunk_store_saves_and_loads_a_segmented_state_and_shares_a_resident_one(engine, tmp_path):
    out, _ = run(engine, random_prompt(37, 14))
    flat = out.state
    store = ChunkStore(tmp_path, engine.spec, engine.state_dtypes, PrefixHasher(b"id", chunk_tokens=8))
    stored = store.save(segmented(flat, 13))  # a chunk (8..16) spans the segments' boundary
    assert store.save(flat).pieces == stored.pieces  # the same bytes, so the same files
    loaded = store.load(stored, flat.tokens[flat.state_len :])
    assert_same_kv(loaded, flat, flat.state_len)
    resident = SequenceState(flat.tokens[:28], 28, flat.recurrent, kv_segments=tuple(flat.kv_pieces(0, 20) + flat.kv_pieces(20, 28)))
    shared = store.load(stored, flat.tokens[flat.state_len :], resident=resident)
    assert store.stats.pieces_resident == 3  # pieces 0..24 are resident: only the later ones are read
    assert [(s.start, s.end) for s in shared.kv_segments] == [(0, 20), (20, 24), (24, flat.state_len)]
    name = flat.kv_names[0]
    assert block(shared.kv_segments[0].tensors[name]) == block(flat.tensors[name])
    assert_same_kv(shared, flat, flat.state_len)
    check_state(engine.spec, engine.state_dtypes, shared)


def test_check_state_names_a_bad_segment(engine):
    out, _ = run(engine, random_prompt(12, 15))
    state = segmented(out.state, 5)
    check_state(engine.spec, engine.state_dtypes, state)
    name = state.kv_names[0]
    bad = dict(state.kv_segments[1].tensors, **{name: state.kv_segments[1].tensors[name].to(torch.float64)})
    broken = SequenceState(state.tokens, state.state_len, state.tensors, kv_segments=(state.kv_segments[0], KVSegment(5, state.state_len, bad)))
    with pytest.raises(ValueError, match=rf"{name}\[5:{state.state_len}\] has dtype"):
        check_state(engine.spec, engine.state_dtypes, broken)
    with pytest.raises(ValueError, match="do not cover"):
        SequenceState(state.tokens, state.state_len, state.tensors, kv_segments=state.kv_segments[1:])
    assert not state.without_attention_kv().kv_names


def test_the_warm_tier_counts_a_shared_block_once_until_no_state_holds_it():
    shared = KVSegment(0, 4, {"layers.1.k": torch.zeros(4, 2, 8), "layers.1.v": torch.zeros(4, 2, 8)})  # 2 x 256 bytes

    def state(rows: int) -> SequenceState:
        tail = KVSegment(4, 4 + rows, {"layers.1.k": torch.zeros(rows, 2, 8), "layers.1.v": torch.zeros(rows, 2, 8)})
        return SequenceState(list(range(4 + rows)), 4 + rows, {"layers.0.ssm": torch.zeros(16)}, kv_segments=(shared, tail))

    warm = WarmCache(8, 1 << 20)
    warm.put("c", "1", state(1))  # 512 shared + 2 x 64 + 64
    assert warm.nbytes == 512 + 128 + 64
    warm.put("c", "2", state(2))  # + 2 x 128 + 64
    assert warm.nbytes == 512 + 128 + 64 + 256 + 64
    warm.drop("c", "1")
    assert warm.nbytes == 512 + 256 + 64
    warm.drop("c", "2")
    assert warm.nbytes == 0


def test_an_adopted_sequence_recomputed_after_a_preemption_does_not_share_its_base(checkpoint_dir):
    engine = make_engine(checkpoint_dir("nemotron"), max_total_tokens=96, context_length=96, kv_block_size=16, max_running_requests=4)
    head, _ = run(engine, random_prompt(20, 16), max_tokens=2, retain_key="a")
    prompt = head.state.tokens + random_prompt(4, 17)
    engine.add_request("long", random_prompt(30, 18), greedy(40))
    engine.add_request("b", prompt, greedy(30), capture_state=True, resume_key="a", host_base=head.state)
    outs = run_to_end(engine)
    assert engine.stats().num_preemptions > 0 and outs["b"].num_cached_tokens == 0  # the adopted slot went with the preemption
    state = outs["b"].state
    assert not state.kv_segments  # its pages were recomputed: nothing of the base's host KV is theirs
    reference = full(engine, prompt, max_tokens=30)
    assert outs["b"].token_ids == reference.token_ids
    assert_same_kv(state, reference.state, state.state_len)


def test_a_state_larger_than_the_warm_budget_pushes_no_other_state_out():
    def state(rows: int) -> SequenceState:
        return SequenceState(list(range(rows)), rows, {"layers.0.ssm": torch.zeros(16), "layers.1.k": torch.zeros(rows, 2, 8)})

    warm, evicted = WarmCache(8, 2048), []
    warm.on_evict = lambda cid, ref, s: evicted.append(cid)
    warm.put("a", "1", state(2))  # 64 + 128 bytes
    warm.put("b", "1", state(2))
    warm.put("huge", "1", state(64))  # 64 + 4096 bytes: more than the whole budget
    assert warm.peek("huge", "1") is None and evicted == []
    assert warm.peek("a", "1") is not None and warm.peek("b", "1") is not None and warm.nbytes == 2 * (64 + 128)
