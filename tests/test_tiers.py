"""The state tiers with an injectable clock: every transition, budgets, exact resume from each tier."""

from __future__ import annotations

import pytest
import torch
from engine_utils import greedy, make_engine, random_prompt, run_to_end

from engram.state.conversations import ConversationManager, SnapshotPolicy, SnapshotTrigger, TierConfig, retain_key
from engram.state.health import HealthConfig, HealthMonitor, HealthPolicy
from engram.state.identity import ModelIdentity, tokenizer_fingerprint
from engram.state.sequence_state import SequenceState
from engram.state.store import WarmCache


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return make_engine(checkpoint_dir("nemotron"), max_running_requests=4)


def manager_for(engine, root, clock, policy=SnapshotPolicy(), tiers=TierConfig(active_timeout=10, warm_timeout=100), warm=(64, 1 << 30), health=None):
    return ConversationManager(
        engine.spec,
        engine.state_dtypes,
        ModelIdentity.of(engine.spec, engine.model_path),
        tokenizer_fingerprint(engine.model_path),
        policy,
        root,
        WarmCache(*warm),
        tiers,
        clock=clock,
        health=health,
    )


def turn(engine, manager, conv_id, new, max_tokens=6, state_edit=None):
    plan = manager.begin(conv_id)
    prompt = plan.history_tokens + new
    kwargs = {"retain_key": retain_key(conv_id, plan.ref)} if manager.tiers.enabled else {}
    engine.add_request(
        "t", prompt, greedy(max_tokens), initial_state=plan.state, capture_state=True, resume_key=plan.resume_key, host_base=plan.host_base, **kwargs
    )
    out = run_to_end(engine)["t"]
    state = state_edit(out.state) if state_edit else out.state
    manager.finish(plan, prompt, out.token_ids, [{"role": "user", "content": "x"}], state)
    return plan, out


def full(engine, tokens, max_tokens=6):
    engine.add_request("full", tokens, greedy(max_tokens))
    return run_to_end(engine)["full"].token_ids


def history(manager, conv_id):
    conv = manager.require(conv_id)
    return conv.tokens(conv.latest("main"))


def release(engine, keys):
    for key in keys:
        engine.release_retained(key)


def test_every_transition_keeps_resume_exact(engine, tmp_path):
    clock = Clock()
    m = manager_for(engine, tmp_path, clock)
    turn(engine, m, "c", random_prompt(12, 1))
    assert m.state_stats()["tiers"]["active"]["turns"] == 1 and engine.stats().retained_slots == 1

    def continue_and_check(expected_tier: str) -> None:
        new = random_prompt(5, int(clock.now))
        before = history(m, "c")
        plan, out = turn(engine, m, "c", new)
        assert plan.state_tier == expected_tier
        assert out.token_ids == full(engine, before + new)
        assert out.num_cached_tokens == len(before) - 1

    continue_and_check("active")  # the slot is adopted as it is

    clock.now += 11  # ACTIVE -> WARM
    keys = m.maintain()
    assert keys == [retain_key("c", "main/000002")]
    release(engine, keys)
    assert engine.stats().retained_slots == 0
    continue_and_check("warm")

    clock.now += 101  # ACTIVE -> WARM -> COLD (the snapshot file stays)
    release(engine, m.maintain())
    assert len(m.warm) == 0 and m.stats.demotions["warm_to_cold"] >= 1
    continue_and_check("cold")
    assert m.stats.promotions["cold_to_warm"] == 1

    stats = m.state_stats()
    assert stats["hits"] == {"active": 1, "warm": 1, "cold": 1} and stats["misses"] == 0
    assert m.stats.restore_seconds["cold"].count == 0  # observed by the server, per first output


def test_warm_to_cold_writes_the_snapshot_first_unless_manual_only(engine, tmp_path):
    clock = Clock()
    m = manager_for(engine, tmp_path, clock, policy=SnapshotPolicy(SnapshotTrigger.EVERY_N_TURNS, every_n_turns=5))
    turn(engine, m, "d", random_prompt(8, 2))
    assert m.snapshots("d") == []
    clock.now += 200
    release(engine, m.maintain())
    assert [s["turn"] for s in m.snapshots("d")] == [1]  # demotion wrote it: nothing lost

    m2 = manager_for(engine, tmp_path / "manual", clock, policy=SnapshotPolicy(SnapshotTrigger.MANUAL_ONLY))
    turn(engine, m2, "e", random_prompt(8, 3))
    clock.now += 200
    release(engine, m2.maintain())
    new = random_prompt(4, 4)
    before = history(m2, "e")
    plan, out = turn(engine, m2, "e", new)
    assert plan.state is None and plan.state_tier is None  # the state is gone; the tokens are not
    assert out.token_ids == full(engine, before + new) and m2.stats.misses == 1


def test_cold_retention_expires_idle_conversations(engine, tmp_path):
    clock = Clock()
    m = manager_for(engine, tmp_path, clock, tiers=TierConfig(active_timeout=10, warm_timeout=100, cold_retention=1000))
    turn(engine, m, "old", random_prompt(6, 5))
    clock.now += 500
    turn(engine, m, "young", random_prompt(6, 6))
    clock.now += 600
    release(engine, m.maintain())
    assert m.get("old") is None and not (tmp_path / "old").exists()
    assert m.get("young") is not None and m.stats.expired_conversations == 1


def test_warm_budgets_are_never_exceeded(engine, tmp_path):
    clock = Clock()
    one_state = None

    def remember(state):
        nonlocal one_state
        one_state = state
        return state

    probe = manager_for(engine, None, clock)
    turn(engine, probe, "p", random_prompt(10, 7), state_edit=remember)
    budget = int(one_state.nbytes * 2.5)
    m = manager_for(engine, tmp_path, clock, warm=(3, budget))
    for i in range(6):
        turn(engine, m, f"w{i}", random_prompt(10, 10 + i))
        assert len(m.warm) <= 3 and m.warm.nbytes <= budget
    assert len(m.warm) == 2 and m.stats.demotions["warm_evicted"] == 4
    # the evicted ones resume exactly from their files
    before = history(m, "w0")
    new = random_prompt(3, 99)
    plan, out = turn(engine, m, "w0", new)
    assert plan.state_tier in ("active", "cold") and out.token_ids == full(engine, before + new)


def test_tiers_off_restores_every_turn_from_its_file(engine, tmp_path):
    clock = Clock()
    m = manager_for(engine, tmp_path, clock, tiers=TierConfig(enabled=False), warm=(0, 0))
    engine.flush_cache()  # slots other tests retained
    turn(engine, m, "f", random_prompt(7, 8))
    assert len(m.warm) == 0 and engine.stats().retained_slots == 0
    before = history(m, "f")
    new = random_prompt(4, 9)
    plan, out = turn(engine, m, "f", new)
    assert plan.state_tier == "cold" and out.token_ids == full(engine, before + new)


def test_async_durability_writes_behind_and_flushes(engine, tmp_path):
    m = manager_for(engine, tmp_path, Clock(), tiers=TierConfig(durability="async"))
    for i in range(3):
        turn(engine, m, "g", random_prompt(5, 20 + i))
    m.close()
    assert [s["turn"] for s in m.snapshots("g")] == [1, 2, 3]
    restarted = manager_for(engine, tmp_path, Clock())
    assert restarted.require("g").latest("main").turn == 3


def test_preload_warms_the_most_recent_conversations(engine, tmp_path):
    clock = Clock()
    m = manager_for(engine, tmp_path, clock)
    for name in ("a", "b", "c"):
        turn(engine, m, name, random_prompt(5, ord(name)))
    release(engine, m.maintain())
    fresh = manager_for(engine, tmp_path, clock)
    assert fresh.preload(2) == 2 and len(fresh.warm) == 2
    assert fresh.begin("c").state_tier == "warm"


def test_anomalous_state_is_quarantined_and_not_restored(engine, tmp_path):
    clock = Clock()
    health = HealthMonitor(HealthConfig(check_interval=1, policy=HealthPolicy.REFUSE_RESTORE, warmup=2), clock=clock)
    m = manager_for(engine, tmp_path, clock, health=health)
    for i in range(3):
        turn(engine, m, "h", random_prompt(5, 30 + i))

    def blow_up(state: SequenceState) -> SequenceState:
        tensors = {k: v * 1e4 if k.endswith(".ssm") else v for k, v in state.tensors.items()}
        return SequenceState(state.tokens, state.state_len, tensors)

    turn(engine, m, "h", random_prompt(5, 40), state_edit=blow_up)
    quarantined = m.quarantine.list("h")
    assert [q["ref"] for q in quarantined] == ["main/000004"] and "layers.0.ssm" in quarantined[0]["reason"]
    plan = m.begin("h")  # turn 4's engine slot is still kept, but it holds the quarantined state
    assert plan.resume_key is None and plan.state_tier in ("warm", "cold")
    assert plan.state is not None and plan.state.state_len < len(history(m, "h")) - 1  # turn 3's state, not turn 4's
    assert health.stats.refused_restores >= 1
    m.release("h")
    assert manager_for(engine, tmp_path, clock).quarantine.is_quarantined("h", "main/000004")  # survives a restart


def test_a_quarantined_warm_state_lends_no_kv_to_a_load(engine, tmp_path):
    """A load takes the KV prefix a warm state holds instead of reading it (`_resident_prefix`); a
    quarantined state's must not stand in for the verified file: its rows before the turn it
    continues were never checked (health reads only the KV a turn added)."""
    clock = Clock()
    health = HealthMonitor(HealthConfig(check_interval=1, policy=HealthPolicy.REFUSE_RESTORE, warmup=2), clock=clock)
    m = manager_for(engine, tmp_path, clock, health=health)
    for i in range(3):
        turn(engine, m, "q", random_prompt(5, 70 + i))
    parent_len = m.require("q").latest("main").state_len

    def damaged(state: SequenceState) -> SequenceState:
        tensors = {k: v * 1e4 if k.endswith(".ssm") else v.clone() for k, v in state.flat_tensors().items()}
        for name in state.kv_names:
            tensors[name][:parent_len] = 100.0  # unchecked rows: the ones the parent turn's file holds too
        return SequenceState(state.tokens, state.state_len, tensors)

    turn(engine, m, "q", random_prompt(5, 80), state_edit=damaged)
    assert [q["ref"] for q in m.quarantine.list("q")] == ["main/000004"]
    m.warm.drop("q", "main/000003")  # turn 3 comes from its file now
    plan = m.begin("q")
    assert plan.state_tier == "cold" and plan.state is not None and plan.state.state_len == parent_len
    before = m.require("q").tokens(m.find_turn(m.require("q"), "main", 3))
    new = random_prompt(4, 81)
    engine.add_request("t", before + new, greedy(6), initial_state=plan.state)
    out = run_to_end(engine)["t"]
    m.release("q")
    assert out.token_ids == full(engine, before + new)


def test_warm_copy_is_independent_of_the_engine_pool(engine, tmp_path):
    """A captured state is a copy: later steps in the slot it came from do not change it."""
    m = manager_for(engine, None, Clock())
    plan, out = turn(engine, m, "i", random_prompt(6, 50))
    saved = {k: v.clone() for k, v in out.state.tensors.items()}
    turn(engine, m, "other", random_prompt(30, 51))
    for name, tensor in out.state.tensors.items():
        assert torch.equal(tensor, saved[name])


def test_startup_reads_no_conversation_until_it_is_used(engine, tmp_path, monkeypatch):
    """Lazy indexing: a server over many saved conversations opens none of them at start-up."""
    m = manager_for(engine, tmp_path, Clock())
    for i in range(5):
        turn(engine, m, f"s{i}", random_prompt(4, 60 + i), max_tokens=2)
    opened = []
    real = ConversationManager.get

    def counting_get(self, conversation_id):
        opened.append(conversation_id)
        return real(self, conversation_id)

    monkeypatch.setattr(ConversationManager, "get", counting_get)
    reads = []
    monkeypatch.setattr("engram.state.cold.load_turn", lambda *a, **k: reads.append(a) or (_ for _ in ()).throw(AssertionError))
    restarted = manager_for(engine, tmp_path, Clock())
    restarted.maintain()
    assert opened == [] and reads == []
    monkeypatch.undo()
    assert restarted.begin("s3").state_tier == "cold"  # and the first use finds it


def test_a_snapshot_whose_record_was_never_written_is_not_listed_and_is_removed(engine, tmp_path, monkeypatch):
    """A crash after a snapshot's commit but before its record's: the turn was never recorded."""
    m = manager_for(engine, tmp_path, Clock())
    turn(engine, m, "o", random_prompt(5, 70), max_tokens=2)

    def crash(self, conv):
        raise SystemExit("killed between the snapshot and the record")

    monkeypatch.setattr(ConversationManager, "_persist", crash)
    with pytest.raises(SystemExit):
        turn(engine, m, "o", random_prompt(5, 71), max_tokens=2)
    monkeypatch.undo()
    orphan = tmp_path / "o" / "main" / "000002.json"
    assert orphan.is_file()
    restarted = manager_for(engine, tmp_path, Clock())
    assert [s["turn"] for s in restarted.snapshots("o")] == [1] and not orphan.exists()
    assert restarted.require("o").latest("main").turn == 1


def test_a_cold_load_does_not_hold_up_other_conversations(engine, tmp_path, monkeypatch):
    import threading

    from engram.state import cold

    m = manager_for(engine, tmp_path, Clock())
    turn(engine, m, "slow", random_prompt(5, 80), max_tokens=2)
    restarted = manager_for(engine, tmp_path, Clock())
    loading, release = threading.Event(), threading.Event()
    real_load = cold.load_turn

    def blocking_load(*args, **kwargs):
        loading.set()
        assert release.wait(30)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(cold, "load_turn", blocking_load)
    plans = {}
    worker = threading.Thread(target=lambda: plans.setdefault("slow", restarted.begin("slow")))
    worker.start()
    assert loading.wait(30)
    plans["other"] = restarted.begin("other")  # a new conversation, while "slow" is still loading
    release.set()
    worker.join(30)
    assert plans["other"].state is None and plans["slow"].state_tier == "cold"


def counting_loads(manager) -> list[str]:
    """Every cold-store load of `manager` from now on (the location it read)."""
    loads: list[str] = []
    real = manager.store.load

    def load(location, resident=None, staging=None):
        loads.append(location)
        return real(location, resident, staging)

    manager.store.load = load
    return loads


def finish_turn(engine, manager, plan, new, **engine_kwargs):
    """Run the turn `plan` starts with `new` tokens in the engine, handing the engine's slot handle to the manager."""
    prompt = plan.history_tokens + new
    engine.add_request(
        "t",
        prompt,
        greedy(4),
        initial_state=plan.state,
        capture_state=True,
        resume_key=plan.resume_key,
        retain_key=retain_key(plan.conversation_id, plan.ref),
        **engine_kwargs,
    )
    out = run_to_end(engine)["t"]
    manager.finish(plan, prompt, out.token_ids, [{"role": "user", "content": "x"}], out.state, retained=out.retained)
    return out


def test_a_resumed_turn_whose_slot_is_retained_reads_nothing_and_falls_back_only_when_it_is_gone(engine, tmp_path):
    from engram.engine.request import SlotNotRetainedError

    m = manager_for(engine, tmp_path, Clock())
    finish_turn(engine, m, m.begin("r"), random_prompt(9, 90))
    m.warm.drop("r", "main/000001")  # the only other copy is the snapshot: a fallback would read it
    loads = counting_loads(m)
    plan = m.begin("r")
    assert (plan.state_tier, plan.state, loads) == ("active", None, [])  # nothing fetched for a slot that is adopted
    new = random_prompt(5, 91)
    before = history(m, "r")
    computed = engine.stats().prefill_tokens_computed_total
    out = finish_turn(engine, m, plan, new, require_adoption=True)
    assert engine.stats().prefill_tokens_computed_total - computed == len(new) + 1 and loads == []
    assert m.state_stats()["tiers"]["active"]["turns"] == 1  # the new turn's slot; the adopted one is no one's now
    assert out.token_ids == full(engine, before + new, max_tokens=4)

    m.warm.drop("r", "main/000002")
    plan = m.begin("r")
    assert plan.state_tier == "active"
    engine.release_retained(plan.resume_key)  # reclaimed between the plan and the request
    new, before = random_prompt(4, 92), history(m, "r")
    with pytest.raises(SlotNotRetainedError):
        engine.add_request("t", plan.history_tokens + new, greedy(4), resume_key=plan.resume_key, require_adoption=True)
    m.fall_back(plan)  # only now is the state fetched
    assert plan.state_tier == "cold" and plan.resume_key is None and len(loads) == 1
    out = finish_turn(engine, m, plan, new)
    assert out.token_ids == full(engine, before + new, max_tokens=4) and out.num_cached_tokens == len(before) - 1
    assert m.state_stats()["hits"] == {"active": 1, "warm": 0, "cold": 1}


def test_the_server_fetches_the_fallback_state_only_once_adoption_failed(engine, tmp_path):
    import asyncio

    from engram.server.conversations import ConversationTurns

    m = manager_for(engine, tmp_path, Clock())
    finish_turn(engine, m, m.begin("s"), random_prompt(8, 95))
    plan = m.begin("s")
    engine.release_retained(plan.resume_key)  # reclaimed after the plan
    new, before, calls = random_prompt(4, 96), history(m, "s"), []

    async def generate(**kwargs):
        calls.append(dict(kwargs))
        engine.add_request("t", plan.history_tokens + new, greedy(4), **kwargs)
        return run_to_end(engine)["t"]

    out = asyncio.run(ConversationTurns(m, tokenizer=None).start(plan, generate))
    assert [(c["resume_key"] is not None, c["require_adoption"]) for c in calls] == [(True, True), (False, False)]
    assert calls[1]["initial_state"] is plan.state and plan.state_tier == "warm"
    assert out.token_ids == full(engine, before + new, max_tokens=4) and out.num_cached_tokens == len(before) - 1
    m.release("s")


def test_a_slot_whose_request_never_came_is_still_released_when_idle(engine, tmp_path):
    clock = Clock()
    m = manager_for(engine, tmp_path, clock)
    finish_turn(engine, m, m.begin("n"), random_prompt(6, 97))
    plan = m.begin("n")
    m.release("n")  # refused before it reached the engine (a template error, a client gone)
    assert m.tier_of("n", m.require("n").latest("main")) == "active"
    clock.now += 11
    assert m.maintain() == [plan.resume_key]
