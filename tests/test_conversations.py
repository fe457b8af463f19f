"""ConversationManager with a real engine: exact continuation from warm and cold states,
branches, regeneration, policies, retention, restart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import greedy, make_engine, manager_of, random_prompt, run_to_end, store_file

from engram.state.conversations import (
    ConversationBusyError,
    ConversationConflictError,
    ConversationManager,
    ConversationNotFoundError,
    ConversationRecordError,
    SnapshotPolicy,
    SnapshotTrigger,
    TierConfig,
    ref_name,
    retain_key,
)
from engram.state.health import Decision, HealthMonitor
from engram.state.sequence_state import SequenceState
from engram.state.snapshot import SnapshotCorruptError
from engram.state.store import WarmCache


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return make_engine(checkpoint_dir("nemotron"))


def manager_for(engine, root, policy=SnapshotPolicy(), warm_entries=64) -> ConversationManager:
    return manager_of(engine, root, policy=policy, warm=WarmCache(warm_entries, 1 << 30))


def take_turn(engine, manager, conv_id, new_tokens, branch="main", from_turn=None, max_tokens=8):
    plan = manager.begin(conv_id, branch, from_turn)
    prompt = plan.history_tokens + new_tokens
    before = engine.stats().prefill_tokens_computed_total
    engine.add_request(
        "t",
        prompt,
        greedy(max_tokens),
        initial_state=plan.state,
        capture_state=True,
        retain_key=retain_key(conv_id, plan.ref),
        resume_key=plan.resume_key,
        host_base=plan.host_base,
    )
    out = run_to_end(engine)["t"]
    computed = engine.stats().prefill_tokens_computed_total - before
    turn = manager.finish(plan, prompt, out.token_ids, [{"role": "user", "content": str(new_tokens)}], out.state)
    return turn, out, computed, plan


def full_generation(engine, tokens, max_tokens=8):
    engine.add_request("full", tokens, greedy(max_tokens))
    return run_to_end(engine)["full"].token_ids


def fail_record_writes(monkeypatch, errno: int = 28) -> None:
    """Every write of a conversation record raises OSError(errno) until monkeypatch.undo()."""
    from engram.state import records

    real_write = records.atomic_write

    def failing_record_write(path, data):
        if path.name == records.RECORD_NAME:
            raise OSError(errno, "injected record write failure")
        real_write(path, data)

    monkeypatch.setattr(records, "atomic_write", failing_record_write)


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

    # regenerate turn 2 of main from turn 1: the new turn 2 keeps its engine slot
    t2b, o2b, *_ = take_turn(engine, manager, "c2", random_prompt(6, 4), from_turn=1)
    assert t2b.turn == 2 and manager.require("c2").latest("main") is t2b
    assert manager.maintain() == []
    # a branch sees its own turns and its ancestors', never main's later ones
    take_turn(engine, manager, "c2", random_prompt(3, 5))  # main/000003
    with pytest.raises(ConversationNotFoundError, match="no turn 3 on branch 'alt'"):
        manager.find_turn(manager.require("c2"), "alt", 3)

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


def test_the_warm_limit_counts_conversations_not_their_turns(engine, tmp_path):
    manager = manager_for(engine, None, warm_entries=2)
    take_turn(engine, manager, "a", random_prompt(4, 1), max_tokens=2)
    for seed in (2, 3):
        take_turn(engine, manager, "b", random_prompt(4, seed), max_tokens=2)
    assert len(manager.warm) == 3  # a's turn, b's two turns: two conversations
    assert manager.warm.peek("a", "main/000001") is not None


def test_the_warm_limit_evicts_the_least_recently_used_conversation_whole():
    warm, evicted = WarmCache(2, 1 << 30), []
    warm.on_evict = lambda cid, ref, state: evicted.append((cid, ref))
    for cid, ref in (("a", "1"), ("b", "1"), ("a", "2"), ("b", "2"), ("c", "1")):
        warm.put(cid, ref, SequenceState([1], 1, {"layers.0.ssm": torch.zeros(1)}))
    assert evicted == [("a", "1"), ("a", "2")]  # a's latest use is older than b's: a goes, b keeps both turns
    assert len(warm) == 3 and warm.peek("b", "1") is not None


def test_delete_conversation_removes_files(engine, tmp_path):
    manager = manager_for(engine, tmp_path)
    take_turn(engine, manager, "c7", random_prompt(4, 1), max_tokens=2)
    assert (tmp_path / "c7").is_dir()
    manager.delete_conversation("c7")
    assert not (tmp_path / "c7").exists()
    with pytest.raises(ConversationNotFoundError):
        manager.require("c7")


# ---- failures and damaged files ---------------------------------------------------------------------


def _rewrite_manifest(path, **changes) -> None:
    """Rewrite a turn's manifest with fields changed (None: removed), its store files untouched."""
    import json

    manifest = json.loads(path.read_text())
    manifest.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del manifest[key]
    path.write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def mamba_engine(checkpoint_dir):
    return make_engine(checkpoint_dir("mamba2"))  # no KV: a wrong state_len shows in no tensor's shape


@pytest.mark.parametrize("damage", ["state_len", "no_turn", "other_conversation"])
def test_a_snapshot_that_does_not_belong_to_its_turn_is_refused(mamba_engine, tmp_path, damage):
    engine = mamba_engine
    manager = manager_for(engine, tmp_path)
    for cid in ("a", "b"):
        take_turn(engine, manager, cid, random_prompt(6, 1 if cid == "a" else 2), max_tokens=3)
    path = tmp_path / "b" / "main" / "000001.json"
    if damage == "other_conversation":
        path.write_bytes((tmp_path / "a" / "main" / "000001.json").read_bytes())
    else:
        turn = manager.require("b").latest("main")
        _rewrite_manifest(path, **({"state_len": turn.state_len + 1} if damage == "state_len" else {"turn": None}))
    restarted = manager_for(engine, tmp_path)
    conv = restarted.require("b")
    with pytest.raises(SnapshotCorruptError, match="manifest names|do not agree"):
        restarted.load_into_warm("b", conv.latest("main"))
    with pytest.raises(SnapshotCorruptError):
        restarted.snapshot_manifest("b", conv.latest("main"))
    assert [(s["conversation_id"], s["turn"]) for s in restarted.snapshots()] == [("a", 1)]  # the damaged one left out


def test_a_damaged_snapshot_is_quarantined_and_the_next_turn_resumes_from_an_earlier_one(engine, tmp_path):
    manager = manager_for(engine, tmp_path)
    take_turn(engine, manager, "d", random_prompt(6, 1), max_tokens=3)
    take_turn(engine, manager, "d", random_prompt(5, 2), max_tokens=3)
    path = store_file(tmp_path / "d" / "main" / "000002.json")  # turn 2's own checkpoint
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # tensor bytes: the checksum no longer matches
    path.write_bytes(bytes(data))
    restarted = manager_for(engine, tmp_path)
    conv = restarted.require("d")
    history = conv.tokens(conv.latest("main"))
    new = random_prompt(4, 3)
    turn, out, _, plan = take_turn(engine, restarted, "d", new, max_tokens=3)
    assert turn.turn == 3 and plan.state.state_len < len(history) - 1  # from turn 1's snapshot, turn 2 recomputed
    assert out.token_ids == full_generation(engine, history + new, max_tokens=3)
    held = restarted.quarantine.list("d")
    assert [q["ref"] for q in held] == [ref_name("main", 2)] and "checksum" in held[0]["reason"]


def test_a_snapshot_that_could_not_be_read_is_not_quarantined(engine, tmp_path, monkeypatch):
    manager = manager_for(engine, tmp_path)
    take_turn(engine, manager, "io", random_prompt(6, 1), max_tokens=3)
    restarted = manager_for(engine, tmp_path)

    def too_many_open_files(*args):
        try:
            raise OSError(24, "Too many open files")
        except OSError as e:
            raise SnapshotCorruptError("000001.safetensors: unreadable: [Errno 24]") from e

    monkeypatch.setattr(restarted, "_load_turn", too_many_open_files)
    assert restarted.begin("io").state is None  # recomputed this time
    assert restarted.quarantine.list("io") == []  # and the file is still trusted


def test_an_unreadable_quarantine_list_stops_the_start(engine, tmp_path):
    (tmp_path / "quarantine.json").write_text("{garbage")
    with pytest.raises(ValueError, match="quarantine.json: unreadable quarantine list"):
        manager_for(engine, tmp_path)


def test_a_snapshot_that_cannot_be_written_leaves_the_turn_recorded_without_it(engine, tmp_path, monkeypatch):
    manager = manager_for(engine, tmp_path)
    take_turn(engine, manager, "f", random_prompt(6, 1), max_tokens=3)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("engram.state.cold.save_turn", disk_full)
    turn, _, _, _ = take_turn(engine, manager, "f", random_prompt(5, 2), max_tokens=3)
    monkeypatch.undo()
    assert turn.turn == 2 and not turn.snapshot and manager.stats.snapshot_write_failures == 1
    restarted = manager_for(engine, tmp_path)
    conv = restarted.require("f")
    assert [t.turn for t in conv.turns.values()] == [1, 2] and conv.latest("main").snapshot is False
    history = conv.tokens(conv.latest("main"))
    new = random_prompt(4, 3)
    turn, out, _, plan = take_turn(engine, restarted, "f", new, max_tokens=3)
    assert turn.turn == 3 and plan.state.state_len < len(history) - 1  # from turn 1's snapshot, turn 2 recomputed
    assert out.token_ids == full_generation(engine, history + new, max_tokens=3)


def test_a_record_that_cannot_be_written_undoes_the_turn(engine, tmp_path, monkeypatch):
    from engram.state import records

    manager = manager_for(engine, tmp_path)
    take_turn(engine, manager, "r", random_prompt(6, 1), max_tokens=3)
    real_write = records.atomic_write

    def failing_record_write(path, data):
        if path.name == records.RECORD_NAME:
            raise OSError(28, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(records, "atomic_write", failing_record_write)
    with pytest.raises(OSError):
        take_turn(engine, manager, "r", random_prompt(5, 2), max_tokens=3)
    monkeypatch.undo()
    conv = manager.require("r")
    assert [t.turn for t in conv.turns.values()] == [1]  # memory agrees with the disk
    assert not (tmp_path / "r" / "main" / "000002.json").exists()
    assert take_turn(engine, manager, "r", random_prompt(5, 2), max_tokens=3)[0].turn == 2  # a retry is turn 2 again


def test_a_regenerate_whose_record_cannot_be_written_keeps_the_turns_it_would_replace(engine, tmp_path, monkeypatch):
    """A full disk during a regenerate: the old turns and their snapshots stay, in memory and on
    disk, and go on exactly (the engine slot the failed turn left behind is not adopted)."""
    manager = manager_for(engine, tmp_path)
    for i in range(3):
        take_turn(engine, manager, "rg", random_prompt(5, i), max_tokens=3)
    history = manager.require("rg").tokens(manager.require("rg").latest("main"))
    fail_record_writes(monkeypatch)
    with pytest.raises(OSError):
        take_turn(engine, manager, "rg", random_prompt(5, 9), from_turn=1, max_tokens=3)
    monkeypatch.undo()
    for current in (manager, manager_for(engine, tmp_path)):  # before and after a restart
        conv = current.require("rg")
        assert sorted(t.turn for t in conv.turns.values()) == [1, 2, 3] and conv.tokens(conv.latest("main")) == history
        assert [s["turn"] for s in current.snapshots("rg")] == [1, 2, 3]
        assert current.snapshot_manifest("rg", conv.latest("main"))["state_len"] == len(history) - 1
    new = random_prompt(4, 7)
    turn, out, _, plan = take_turn(engine, manager, "rg", new, max_tokens=3)
    assert turn.turn == 4 and out.num_cached_tokens == len(history) - 1  # from turn 3's state (its engine slot)
    assert out.token_ids == full_generation(engine, history + new, max_tokens=3)
    turn, out, _, plan = take_turn(engine, manager_for(engine, tmp_path), "rg", random_prompt(4, 8), from_turn=2, max_tokens=3)
    two = manager.require("rg").tokens(manager.require("rg").turns[ref_name("main", 2)])
    assert turn.turn == 3 and plan.state_tier == "cold" and plan.state.state_len == len(two) - 1
    assert out.token_ids == full_generation(engine, two + random_prompt(4, 8), max_tokens=3)


def test_retention_deletes_a_snapshot_only_after_the_record_stops_listing_it(engine, tmp_path, monkeypatch):
    import json

    from engram.state import cold, records

    manager = manager_for(engine, tmp_path, SnapshotPolicy(SnapshotTrigger.EVERY_TURN, retention_count=1))
    real_delete = cold.delete_snapshot
    listed_when_deleted = []

    def delete(path):
        record = json.loads((tmp_path / "k" / records.RECORD_NAME).read_text())
        turn = int(Path(path).stem)
        listed_when_deleted.append([t["snapshot"] for t in record["turns"] if t["turn"] == turn][0])
        real_delete(path)

    monkeypatch.setattr(cold, "delete_snapshot", delete)
    for i in range(3):
        take_turn(engine, manager, "k", random_prompt(4, i), max_tokens=2)
    assert listed_when_deleted == [False, False]
    assert [s["turn"] for s in manager.snapshots("k")] == [3]


def test_a_manual_save_that_retention_would_delete_at_once_is_refused(engine, tmp_path):
    manager = manager_for(engine, tmp_path, SnapshotPolicy(SnapshotTrigger.MANUAL_ONLY, retention_count=1))
    for i in range(2):
        take_turn(engine, manager, "m", random_prompt(4, i), max_tokens=2)
    manager.save("m", "main", 2)
    with pytest.raises(ConversationConflictError, match="retention"):
        manager.save("m", "main", 1)
    assert [s["turn"] for s in manager.snapshots("m")] == [2]


def test_deleting_a_conversation_hands_its_engine_slot_back(engine, tmp_path):
    manager = manager_for(engine, tmp_path)
    take_turn(engine, manager, "d", random_prompt(4, 1), max_tokens=2)
    manager.delete_conversation("d")
    assert manager.maintain() == [retain_key("d", "main/000001")]
    assert manager.maintain() == []


def test_idle_demotion_that_cannot_write_keeps_the_state_warm(engine, tmp_path, monkeypatch):
    now = [0.0]
    manager = manager_of(
        engine,
        tmp_path,
        policy=SnapshotPolicy(SnapshotTrigger.EVERY_N_TURNS, every_n_turns=2),
        warm=WarmCache(8, 1 << 30),
        tiers=TierConfig(active_timeout=10, warm_timeout=20),
        clock=lambda: now[0],
    )
    take_turn(engine, manager, "w", random_prompt(4, 1), max_tokens=2)  # turn 1: no snapshot by the policy
    monkeypatch.setattr("engram.state.cold.save_turn", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "disk full")))
    now[0] = 100.0
    assert manager.maintain() == [retain_key("w", "main/000001")]  # the slot is released all the same
    assert manager.warm.peek("w", "main/000001") is not None
    monkeypatch.undo()
    now[0] = 200.0
    manager.maintain()  # the disk is back: written, then dropped from memory
    assert manager.warm.peek("w", "main/000001") is None
    assert [s["turn"] for s in manager.snapshots("w")] == [1]


def test_idle_demotion_does_not_write_a_state_the_health_policy_kept_off_disk(engine, tmp_path):
    class AlwaysAnomalous(HealthMonitor):
        def decide(self, report):
            return Decision(save=False, restore=True, quarantine=True, log=None)

    now = [0.0]
    manager = manager_of(
        engine,
        tmp_path,
        policy=SnapshotPolicy(),
        warm=WarmCache(8, 1 << 30),
        tiers=TierConfig(active_timeout=10, warm_timeout=20),
        clock=lambda: now[0],
        health=AlwaysAnomalous(clock=lambda: now[0]),
    )
    take_turn(engine, manager, "h", random_prompt(4, 1), max_tokens=2)
    now[0] = 100.0
    manager.maintain()
    assert manager.warm.peek("h", "main/000001") is None and manager.snapshots("h") == []


def test_a_damaged_record_is_refused_and_left_out_of_listings(engine, tmp_path):
    manager = manager_for(engine, tmp_path)
    for cid in ("ok", "bad"):
        take_turn(engine, manager, cid, random_prompt(4, 1), max_tokens=2)
    record = tmp_path / "bad" / "conversation.json"
    record.write_text(record.read_text()[:20])
    restarted = manager_for(engine, tmp_path)
    with pytest.raises(ConversationRecordError, match="unreadable") as refused:
        restarted.get("bad")
    assert str(tmp_path) not in str(refused.value)  # the message reaches API clients: no server paths
    assert [s["conversation_id"] for s in restarted.snapshots()] == ["ok"]
    assert restarted.preload(5) == 1
    restarted.delete_conversation("bad")  # deleting it still works
    assert not (tmp_path / "bad").exists() and restarted.get("bad") is None


def test_temp_files_of_killed_writes_are_removed_on_load(engine, tmp_path):
    manager = manager_for(engine, tmp_path)
    take_turn(engine, manager, "t", random_prompt(4, 1), max_tokens=2)
    left = tmp_path / "t" / "main" / ".000002.safetensors.tmp-0123456789ab-0123abcd"
    left.write_bytes(b"partial")
    manager_for(engine, tmp_path).require("t")
    assert not left.exists() and (tmp_path / "t" / "main" / "000001.json").exists()


def test_cleanup_removes_only_temp_files_never_a_folder_named_like_one(engine, tmp_path):
    """A folder (a branch of an older build, which took a leading dot) named like a temp file is no
    temp file of ours: loading the conversation leaves it and still works (listing, preload)."""
    manager = manager_for(engine, tmp_path)
    take_turn(engine, manager, "t", random_prompt(4, 1), max_tokens=2)
    folder = tmp_path / "t" / ".x.tmp-0123456789ab-01234567"
    (folder / "inner").mkdir(parents=True)
    restarted = manager_for(engine, tmp_path)
    assert [s["turn"] for s in restarted.snapshots("t")] == [1] and restarted.preload(1) == 1
    assert (folder / "inner").is_dir()


def test_a_state_pushed_out_of_memory_by_pressure_is_written_first(engine, tmp_path):
    manager = manager_for(engine, tmp_path, SnapshotPolicy(SnapshotTrigger.EVERY_N_TURNS, every_n_turns=2), warm_entries=1)
    take_turn(engine, manager, "p1", random_prompt(4, 1), max_tokens=2)  # turn 1: no snapshot by the policy
    assert manager.snapshots("p1") == []
    take_turn(engine, manager, "p2", random_prompt(4, 2), max_tokens=2)  # pushes p1's state out of the warm cache
    assert [s["turn"] for s in manager.snapshots("p1")] == [1] and manager.stats.demotions["warm_evicted"] == 1


def test_closing_writes_a_record_that_async_durability_failed_to_write(engine, tmp_path, monkeypatch):
    """The turn was answered and no later turn of its conversation rewrote the record: closing does."""
    manager = manager_of(engine, tmp_path, policy=SnapshotPolicy(), warm=WarmCache(8, 1 << 30), tiers=TierConfig(durability="async"))
    fail_record_writes(monkeypatch, errno=5)
    _, out, *_ = take_turn(engine, manager, "ur", random_prompt(5, 1), max_tokens=2)
    manager.writer.flush()
    monkeypatch.undo()
    manager.close()
    conv = manager_for(engine, tmp_path).require("ur")
    assert [t.turn for t in conv.turns.values()] == [1] and conv.latest("main").new_tokens[-2:] == out.token_ids


@pytest.mark.parametrize(
    "trigger, budget, written",
    [
        (SnapshotTrigger.EVERY_N_TURNS, 30.0, [1, 2]),
        (SnapshotTrigger.EVERY_N_TURNS, 0.0, []),  # no time for it
        (SnapshotTrigger.MANUAL_ONLY, 30.0, []),  # the user opted out of automatic snapshots
    ],
)
def test_closing_writes_the_states_only_memory_holds(engine, tmp_path, trigger, budget, written):
    policy = SnapshotPolicy(trigger, every_n_turns=100)
    manager = manager_for(engine, tmp_path, policy)
    for i in range(2):
        take_turn(engine, manager, "sd", random_prompt(4, i), max_tokens=2)
    manager.close(budget)
    assert [s["turn"] for s in manager_for(engine, tmp_path, policy).snapshots("sd")] == written


def test_async_durability_keeps_a_turn_whose_record_write_failed(engine, tmp_path, monkeypatch):
    """Answered already: the turn stays, and the next turn's record write records it."""
    import threading

    from engram.state import records

    manager = manager_of(engine, tmp_path, policy=SnapshotPolicy(), warm=WarmCache(8, 1 << 30), tiers=TierConfig(durability="async"))
    gate = threading.Event()
    manager.writer.submit(gate.wait)  # the writer is held until both turns are recorded in memory
    real_write, failures = records.atomic_write, []

    def first_record_write_fails(path, data):
        if path.name == records.RECORD_NAME and not failures:
            failures.append(path)
            raise OSError(5, "Input/output error")
        real_write(path, data)

    monkeypatch.setattr(records, "atomic_write", first_record_write_fails)
    take_turn(engine, manager, "as", random_prompt(5, 1), max_tokens=2)
    take_turn(engine, manager, "as", random_prompt(5, 2), max_tokens=2)
    gate.set()
    manager.close()
    assert failures
    conv = manager.require("as")
    assert [t.turn for t in conv.turns.values()] == [1, 2] and conv.tokens(conv.latest("main"))
    restarted = manager_for(engine, tmp_path)
    assert [t.turn for t in restarted.require("as").turns.values()] == [1, 2]


@pytest.mark.parametrize(
    "policy, health, written",
    [
        (SnapshotPolicy(SnapshotTrigger.EVERY_N_TURNS, every_n_turns=2), None, True),  # it leaves memory: written first
        (SnapshotPolicy(SnapshotTrigger.MANUAL_ONLY), None, False),
        (SnapshotPolicy(), "anomalous", False),
    ],
)
def test_a_state_too_large_for_the_warm_budget_is_written_as_any_state_leaving_memory(engine, tmp_path, policy, health, written):
    class AlwaysAnomalous(HealthMonitor):
        def decide(self, report):
            return Decision(save=False, restore=True, quarantine=True, log=None)

    manager = manager_of(engine, tmp_path, policy=policy, warm=WarmCache(8, 1), health=AlwaysAnomalous() if health else None)
    take_turn(engine, manager, "big", random_prompt(4, 1), max_tokens=2)
    assert len(manager.snapshots("big")) == int(written) and len(manager.warm) == 0


def test_a_snapshot_retention_cannot_delete_does_not_undo_the_turn(engine, tmp_path, monkeypatch):
    manager = manager_for(engine, tmp_path, SnapshotPolicy(SnapshotTrigger.EVERY_TURN, retention_count=1))
    take_turn(engine, manager, "e", random_prompt(4, 1), max_tokens=2)

    def io_error(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("engram.state.cold.delete_snapshot", io_error)
    turn = take_turn(engine, manager, "e", random_prompt(4, 2), max_tokens=2)[0]
    monkeypatch.undo()
    assert turn.snapshot and [t.turn for t in manager.require("e").turns.values()] == [1, 2]
    restarted = manager_for(engine, tmp_path)
    assert [s["turn"] for s in restarted.snapshots("e")] == [2]
    assert not (tmp_path / "e" / "main" / "000001.json").exists()  # the orphan went on load


def test_another_conversation_begins_while_a_snapshot_file_is_written(engine, tmp_path, monkeypatch):
    """A turn's snapshot (the whole history's KV) is written outside the manager's lock: while one
    conversation's write is held, another conversation's turn is planned; the held turn is then
    recorded with its snapshot as usual."""
    import threading

    from engram.state import cold

    manager = manager_for(engine, tmp_path)
    take_turn(engine, manager, "other", random_prompt(5, 1), max_tokens=3)
    writing, release = threading.Event(), threading.Event()
    save = cold.save_turn

    def held_save(*args, **kwargs):
        writing.set()
        assert release.wait(30)
        return save(*args, **kwargs)

    monkeypatch.setattr(cold, "save_turn", held_save)
    held = threading.Thread(target=take_turn, args=(engine, manager, "held", random_prompt(5, 2)), kwargs={"max_tokens": 3})
    held.start()
    assert writing.wait(30)
    planned = []
    begin = threading.Thread(target=lambda: planned.append(manager.begin("other")))
    begin.start()
    begin.join(10)
    release.set()
    held.join(30)
    assert planned and planned[0].turn == 2  # planned while the other write was still held
    manager.release("other")
    assert [s["turn"] for s in manager.snapshots("held")] == [1]
