"""ConversationManager with a real engine: exact continuation from warm and cold states,
branches, regeneration, policies, retention, restart."""

from __future__ import annotations

import pytest

from engine_utils import greedy, make_engine, random_prompt, run_to_end
from engram.state.conversations import (
    ConversationBusyError,
    ConversationConflictError,
    ConversationManager,
    ConversationNotFoundError,
    SnapshotPolicy,
    SnapshotTrigger,
    retain_key,
)
from engram.state.store import WarmCache
from engram.state.identity import ModelIdentity, tokenizer_fingerprint


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return make_engine(checkpoint_dir("nemotron"))


def manager_for(engine, root, policy=SnapshotPolicy(), warm_entries=64) -> ConversationManager:
    return ConversationManager(
        engine.spec,
        engine.state_dtypes,
        ModelIdentity.of(engine.spec, engine.model_path),
        tokenizer_fingerprint(engine.model_path),
        policy,
        root,
        WarmCache(warm_entries, 1 << 30),
    )


def take_turn(engine, manager, conv_id, new_tokens, branch="main", from_turn=None, max_tokens=8):
    plan = manager.begin(conv_id, branch, from_turn)
    prompt = plan.history_tokens + new_tokens
    before = engine.stats().prefill_tokens_computed_total
    engine.add_request("t", prompt, greedy(max_tokens), initial_state=plan.state, capture_state=True,
                       retain_key=retain_key(conv_id, plan.ref), resume_key=plan.resume_key)
    out = run_to_end(engine)["t"]
    computed = engine.stats().prefill_tokens_computed_total - before
    turn = manager.finish(plan, prompt, out.token_ids, [{"role": "user", "content": str(new_tokens)}], out.state)
    return turn, out, computed, plan


def full_generation(engine, tokens, max_tokens=8):
    engine.add_request("full", tokens, greedy(max_tokens))
    return run_to_end(engine)["full"].token_ids


def test_three_turns_with_restart_equal_full_prefill_and_compute_only_new_tokens(engine, tmp_path):
    manager = manager_for(engine, tmp_path)
    turns = [random_prompt(n, seed=40 + n) for n in (17, 9, 12)]
    history: list[int] = []
    for i, new in enumerate(turns):
        if i == 2:  # a restart: a fresh manager, nothing warm, only the files
            manager = manager_for(engine, tmp_path)
        turn, out, computed, plan = take_turn(engine, manager, "c1", new)
        assert out.token_ids == full_generation(engine, history + new)
        if i == 0:
            assert computed == len(new) and plan.state is None
        else:
            assert plan.state_tier == ("cold" if i == 2 else "active")
            assert computed == len(new) + 1  # the new turn plus the reply's last token, never the history
            assert out.num_cached_tokens == len(history) - 1
        history += new + out.token_ids
        assert turn.turn == i + 1 and manager.require("c1").tokens(turn) == history


def test_branch_fork_and_regenerate(engine, tmp_path):
    manager = manager_for(engine, tmp_path)
    t1, o1, *_ = take_turn(engine, manager, "c2", random_prompt(10, 1))
    t2, o2, *_ = take_turn(engine, manager, "c2", random_prompt(6, 2))
    conv = manager.require("c2")
    base = conv.tokens(t1)

    # fork from turn 1 into a new branch
    new = random_prompt(5, 3)
    t_alt, o_alt, computed, plan = take_turn(engine, manager, "c2", new, branch="alt", from_turn=1)
    assert (t_alt.branch, t_alt.turn, t_alt.parent) == ("alt", 2, "main/000001")
    assert o_alt.token_ids == full_generation(engine, base + new)
    assert computed == len(new) + 1
    assert manager.require("c2").latest("main").turn == 2  # main is untouched

    # regenerate turn 2 of main from turn 1
    t2b, o2b, *_ = take_turn(engine, manager, "c2", random_prompt(6, 4), from_turn=1)
    assert t2b.turn == 2 and manager.require("c2").latest("main") is t2b

    with pytest.raises(ConversationNotFoundError, match="from_turn"):
        manager.begin("c2", branch="nope")
    with pytest.raises(ConversationNotFoundError, match="no turn 9"):
        manager.begin("c2", from_turn=9)


def test_regenerating_a_parent_of_another_branch_is_refused(engine, tmp_path):
    manager = manager_for(engine, tmp_path)
    take_turn(engine, manager, "c3", random_prompt(5, 1))
    take_turn(engine, manager, "c3", random_prompt(5, 2))
    take_turn(engine, manager, "c3", random_prompt(5, 3), branch="b", from_turn=2)
    with pytest.raises(ConversationConflictError, match="parent of branch 'b'"):
        manager.begin("c3", from_turn=1)


def test_busy_conversation_is_refused_until_released(engine, tmp_path):
    manager = manager_for(engine, tmp_path)
    manager.begin("c4")
    with pytest.raises(ConversationBusyError):
        manager.begin("c4")
    manager.release("c4")
    manager.begin("c4")


@pytest.mark.parametrize(
    "policy,expected",
    [
        (SnapshotPolicy(SnapshotTrigger.EVERY_TURN), [1, 2, 3, 4]),
        (SnapshotPolicy(SnapshotTrigger.EVERY_N_TURNS, every_n_turns=2), [2, 4]),
        (SnapshotPolicy(SnapshotTrigger.MANUAL_ONLY), []),
        (SnapshotPolicy(SnapshotTrigger.EVERY_TURN, retention_count=2), [3, 4]),
    ],
)
def test_trigger_policies_and_retention(engine, tmp_path, policy, expected):
    manager = manager_for(engine, tmp_path, policy)
    for i in range(4):
        take_turn(engine, manager, "c5", random_prompt(4, i), max_tokens=2)
    assert [s["turn"] for s in manager.snapshots("c5")] == expected


def test_manual_save_then_cold_resume_from_an_older_snapshot_is_exact(engine, tmp_path):
    manager = manager_for(engine, tmp_path, SnapshotPolicy(SnapshotTrigger.MANUAL_ONLY))
    take_turn(engine, manager, "c6", random_prompt(8, 1))
    manager.save("c6")  # turn 1 saved by hand
    take_turn(engine, manager, "c6", random_prompt(8, 2))  # turn 2 only warm
    history = manager.require("c6").tokens(manager.require("c6").latest("main"))
    restarted = manager_for(engine, tmp_path, SnapshotPolicy(SnapshotTrigger.MANUAL_ONLY))
    new = random_prompt(5, 3)
    turn, out, computed, plan = take_turn(engine, restarted, "c6", new)
    assert plan.state_tier == "cold" and plan.state.state_len < len(history) - 1  # restored turn 1, recomputed turn 2
    assert out.token_ids == full_generation(engine, history + new)
    assert computed == len(history) - plan.state.state_len + len(new)


def test_warm_cache_is_bounded(engine, tmp_path):
    manager = manager_for(engine, None, warm_entries=2)
    for conv in ("a", "b", "c"):
        take_turn(engine, manager, conv, random_prompt(4, 1), max_tokens=2)
    assert len(manager.warm) == 2
    plan = manager.begin("a")  # evicted and no persistence: a full prefill, still exact
    assert plan.state is None


def test_delete_conversation_removes_files(engine, tmp_path):
    manager = manager_for(engine, tmp_path)
    take_turn(engine, manager, "c7", random_prompt(4, 1), max_tokens=2)
    assert (tmp_path / "c7").is_dir()
    manager.delete_conversation("c7")
    assert not (tmp_path / "c7").exists()
    with pytest.raises(ConversationNotFoundError):
        manager.require("c7")
