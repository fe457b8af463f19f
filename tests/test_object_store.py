"""The object-store COLD tier (state/object_store.py) as two replicas see it: two engines, two
conversation managers, each with its own cache folder, over one obstore in-memory store. A turn
continues exactly on the other replica; conditional record writes let exactly one of two racing
replicas record a turn; a replica whose view is stale reads the conversation again."""

from __future__ import annotations

import pytest
from engine_utils import greedy, make_engine, manager_of, random_prompt, run_to_end
from test_conversations import full_generation, take_turn

from engram.state.conversations import ConversationManager
from engram.state.object_store import StoreConfigError, StoreUnavailableError, remote_url
from engram.state.store import WarmCache
from engram.state.tiers import SnapshotPolicy, SnapshotTrigger
from engram.state.turns import ConversationError, StaleViewError, retain_key

obstore = pytest.importorskip("obstore")


@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    path = checkpoint_dir("nemotron")
    return make_engine(path), make_engine(path)


def replica(engine, cache, url="memory:///", shared=None, **fields) -> ConversationManager:
    """A replica with its cache folder `cache`, over the bucket of `shared` if given; `fields`: the manager's keywords."""
    manager = manager_of(engine, cache, chunk_tokens=16, store_url=url, **fields)
    if shared is not None:
        manager.store.remote = shared.store.remote  # one bucket for both
    return manager


@pytest.fixture
def pair(engines, tmp_path):
    a = replica(engines[0], tmp_path / "a")
    return a, replica(engines[1], tmp_path / "b", shared=a)


def test_a_conversation_continues_exactly_on_another_replica_from_the_store(engines, pair):
    (ea, eb), (a, b) = engines, pair
    take_turn(ea, a, "c", random_prompt(20, 1))
    take_turn(ea, a, "c", random_prompt(7, 2))
    history = a.require("c").tokens(a.require("c").latest("main"))
    new = random_prompt(5, 3)
    turn, out, computed, plan = take_turn(eb, b, "c", new)
    assert plan.state_tier == "cold" and plan.turn == 3
    assert computed == len(history) - plan.state.state_len + len(new) <= len(new) + 1  # only past the stored state
    assert out.token_ids == full_generation(eb, history + new)
    assert b.store.stats.pieces_read > 0
    assert a.require("c").latest("main").turn == 3  # the record in the store, as A sees it now
    assert a.list_ids() == b.list_ids() == ["c"]


def test_an_export_from_a_replica_that_never_held_the_state_has_every_file(engines, pair, tmp_path):
    import io

    (ea, _), (a, b) = engines, pair
    take_turn(ea, a, "e", random_prompt(40, 10))
    out = io.BytesIO()
    b.export_conversation("e", None, out)  # B's cache holds none of it
    out.seek(0)
    imported = a.import_conversation(out, None, conversation_id="e2")  # loads and verifies every snapshot
    assert imported.tokens(imported.latest("main")) == a.require("e").tokens(a.require("e").latest("main"))


def test_a_replica_downloads_only_the_store_files_no_warm_state_holds(engines, pair, tmp_path):
    from engram.state.chunks import STORE_NAME

    (ea, eb), (a, b) = engines, pair
    take_turn(ea, a, "w", random_prompt(40, 20))
    take_turn(ea, a, "w", random_prompt(20, 21))
    conv = b.require("w")
    first, second = conv.turns["main/000001"], conv.turns["main/000002"]
    b.load_into_warm("w", second)  # warm on B: it holds turn 1's whole prefix
    for path in (tmp_path / "b" / STORE_NAME).glob("*/*/*"):
        path.unlink()  # B's folder, a cache, has lost the files
    state = b.load_into_warm("w", first)
    fetched = [p.parent.parent.name for p in (tmp_path / "b" / STORE_NAME).glob("*/*/*")]
    assert fetched == ["ckpt"]  # turn 1's checkpoint; its KV pieces came from turn 2's warm state
    prompt = state.tokens + random_prompt(5, 22)
    eb.add_request("r", prompt, greedy(4), initial_state=state)
    assert run_to_end(eb)["r"].token_ids == full_generation(eb, prompt, 4)


def test_two_replicas_racing_one_turn_exactly_one_records_it(engines, pair):
    (ea, eb), (a, b) = engines, pair
    take_turn(ea, a, "r", random_prompt(12, 4))
    assert b.require("r").latest("main").turn == 1
    plan_a, plan_b = a.begin("r"), b.begin("r")
    assert plan_a.turn == plan_b.turn == 2
    take_turn_from(ea, a, plan_a, random_prompt(3, 5))
    with pytest.raises(StaleViewError, match="another replica"):
        take_turn_from(eb, b, plan_b, random_prompt(4, 6))
    turn, out, _, plan = take_turn(eb, b, "r", random_prompt(2, 7))  # B reads the conversation afresh
    assert plan.turn == 3
    winner = a.require("r").turns["main/000002"]
    assert b.require("r").turns["main/000002"].new_tokens == winner.new_tokens
    history = plan.history_tokens + random_prompt(2, 7)
    assert out.token_ids == full_generation(eb, history)


def test_a_replica_whose_view_went_stale_hands_back_the_slot_it_kept(engines, pair):
    """B kept turn 1's engine slot (ACTIVE); A records turn 2: B's next read drops its copy and
    hands the slot back, so that no state of a turn the store may record differently is adopted."""
    (ea, eb), (a, b) = engines, pair
    take_turn(eb, b, "s", random_prompt(8, 11))
    assert b.active.holds("s", "main/000001")
    b.active.take_released()
    take_turn(ea, a, "s", random_prompt(3, 12))
    assert b.require("s").latest("main").turn == 2  # read afresh from the store
    assert not b.active.holds("s", "main/000001")
    assert b.active.take_released() == [retain_key("s", "main/000001")]


def test_a_regenerate_that_loses_the_race_hands_back_the_slot_it_retained(engines, pair):
    """B regenerates turn 2 while A records turn 3: B's record write is refused (409), and the
    engine slot B's request kept under turn 2's key is handed back, not held by no turn."""
    (ea, eb), (a, b) = engines, pair
    take_turn(ea, a, "g", random_prompt(8, 13))
    take_turn(ea, a, "g", random_prompt(3, 14))
    plan_b, plan_a = b.begin("g", from_turn=1), a.begin("g")
    assert (plan_b.turn, plan_a.turn) == (2, 3)
    take_turn_from(ea, a, plan_a, random_prompt(2, 15))
    b.active.take_released()
    key = retain_key("g", plan_b.ref)
    with pytest.raises(StaleViewError):
        take_turn_from(eb, b, plan_b, random_prompt(4, 16), retain=key)
    assert key in eb.scheduler.retained  # the engine still keeps it: the manager must say to free it
    assert key in b.active.take_released()


def test_a_replica_that_loses_the_record_race_leaves_no_snapshot_at_the_winners_turn(engines, tmp_path):
    """B writes turn 2's snapshot first, A then records turn 2 (here without a snapshot: its
    policy writes none), B's record write is refused: B's snapshot of a turn the store does not
    record as its goes with it, so that A can still save its own turn 2."""
    (ea, eb) = engines
    a = manager_of(ea, tmp_path / "a", SnapshotPolicy(SnapshotTrigger.MANUAL_ONLY), chunk_tokens=16, store_url="memory:///")
    b = replica(eb, tmp_path / "b", shared=a)
    take_turn(ea, a, "m", random_prompt(10, 17))
    a.save("m", turn=1)
    plan_a, plan_b = a.begin("m"), b.begin("m")
    take_turn_from(ea, a, plan_a, random_prompt(3, 18))
    with pytest.raises(StaleViewError):
        take_turn_from(eb, b, plan_b, random_prompt(5, 19))
    assert [e["turn"] for e in b.store.snapshots("m")] == [1]
    assert a.save("m", turn=2).snapshot
    continues_from_its_latest_snapshot(ea, replica(ea, tmp_path / "c", shared=a), "m")


def test_a_state_evicted_from_a_stale_conversation_does_not_fail_another_conversations_turn(engines, tmp_path):
    """A keeps one conversation in memory; its two unsaved states of "y" are evicted by a turn
    of "x", after B recorded turn 3 of "y": writing them is refused (409 for "y"), which must
    not become the answer to "x", whose turn is recorded; A reads "y" afresh."""
    (ea, eb) = engines
    a = manager_of(
        ea,
        tmp_path / "a",
        SnapshotPolicy(SnapshotTrigger.EVERY_N_TURNS, every_n_turns=3),
        WarmCache(1, 1 << 30),
        chunk_tokens=16,
        store_url="memory:///",
    )
    b = replica(eb, tmp_path / "b", shared=a)
    take_turn(ea, a, "y", random_prompt(9, 21))
    take_turn(ea, a, "y", random_prompt(4, 22))
    take_turn(eb, b, "y", random_prompt(3, 23))
    turn, out, _, _ = take_turn(ea, a, "x", random_prompt(6, 24))
    assert out.token_ids == full_generation(ea, random_prompt(6, 24))
    assert b.require("x").latest("main").new_tokens == turn.new_tokens  # recorded in the store
    assert a.require("y").latest("main").turn == 3


def test_a_replica_reading_a_conversation_keeps_the_manifest_of_a_turn_being_recorded(engines, pair, tmp_path, monkeypatch):
    """A has written turn 2's manifest and not yet its record when B reads the conversation: the
    manifest the record does not list yet is another replica's turn in flight, not a crash's
    orphan. It stays, and the record A writes next names a manifest that exists."""
    (ea, eb), (a, b) = engines, pair
    take_turn(ea, a, "o", random_prompt(10, 25))
    b.require("o")
    write_record = a.store.write_record

    def b_reads_first(conversation_id, data):
        b._drop_stale(conversation_id)  # B's next look-up reads the record afresh
        b.require(conversation_id)
        write_record(conversation_id, data)

    monkeypatch.setattr(a.store, "write_record", b_reads_first)
    take_turn(ea, a, "o", random_prompt(4, 26))
    monkeypatch.undo()
    assert a.require("o").turns["main/000002"].snapshot
    assert [e["turn"] for e in b.store.snapshots("o")] == [1, 2]
    assert continues_from_its_latest_snapshot(eb, replica(eb, tmp_path / "c", shared=a), "o").parent == "main/000002"


def test_two_replicas_importing_one_conversation_id_leave_the_winners_snapshots(engines, pair, tmp_path, monkeypatch):
    """B imports another export under the id A is importing, between A's manifests and A's
    record: exactly one import is recorded, and every snapshot its record names is its own and
    there (a loser neither overwrites the winner's manifests nor deletes them when it gives up)."""
    import io

    (ea, eb), (a, b) = engines, pair
    exports = {}
    for cid, seed in (("p", 28), ("q", 29)):
        take_turn(ea, a, cid, random_prompt(12, seed))
        exports[cid] = io.BytesIO()
        a.export_conversation(cid, None, exports[cid])
    write_record, refused = a.store.write_record, []

    def b_imports_first(conversation_id, data):
        if conversation_id == "z":
            try:
                b.import_conversation(io.BytesIO(exports["q"].getvalue()), None, conversation_id="z")
            except ConversationError as e:
                refused.append(e)
        write_record(conversation_id, data)

    monkeypatch.setattr(a.store, "write_record", b_imports_first)
    try:
        a.import_conversation(io.BytesIO(exports["p"].getvalue()), None, conversation_id="z")
    except StaleViewError as e:
        refused.append(e)
    monkeypatch.undo()
    assert len(refused) == 1
    continues_from_its_latest_snapshot(eb, replica(eb, tmp_path / "c", shared=a), "z")


def test_two_replicas_creating_one_conversation_exactly_one_records_it(engines, pair):
    (ea, eb), (a, b) = engines, pair
    plan_a, plan_b = a.begin("n"), b.begin("n")
    take_turn_from(ea, a, plan_a, random_prompt(6, 8))
    with pytest.raises(StaleViewError):
        take_turn_from(eb, b, plan_b, random_prompt(6, 9))
    assert b.require("n").turns["main/000001"].new_tokens[:6] == random_prompt(6, 8)


def test_an_unreachable_store_is_an_os_error_naming_the_store(engines, tmp_path):
    manager = replica(engines[0], tmp_path, url="s3://engram-test/p")
    manager.store.remote = obstore.store.S3Store(
        "engram-test",
        endpoint="http://127.0.0.1:9",
        region="us-east-1",
        access_key_id="k",
        secret_access_key="s",
        allow_http=True,
        client_options={"connect_timeout": "1s"},
        retry_config={"max_retries": 0},
    )
    with pytest.raises(StoreUnavailableError, match="the object store s3://engram-test/p failed") as e:
        manager.begin("u")
    assert isinstance(e.value, OSError)


def test_store_urls():
    assert remote_url(None) is None and remote_url("/data/snapshots") is None and remote_url("file:///data") is None
    assert remote_url("s3://b/p") == "s3://b/p"
    with pytest.raises(StoreConfigError, match="scheme"):
        remote_url("ftp://host/x")


def continues_from_its_latest_snapshot(engine, manager, conversation_id):
    """A turn of the conversation on `manager` (a replica that holds none of it) restores its
    latest turn's snapshot and generates what a full prefill does; its plan."""
    history = manager.require(conversation_id).tokens(manager.require(conversation_id).latest("main"))
    new = random_prompt(2, 99)
    _, out, _, plan = take_turn(engine, manager, conversation_id, new)
    assert plan.state_tier == "cold" and plan.state.state_len >= len(history) - 1
    assert out.token_ids == full_generation(engine, history + new)
    return plan


def take_turn_from(engine, manager, plan, new_tokens, retain=None):
    """Finish an already begun turn (a plan from `manager.begin`) on `engine`, its slot kept under `retain`."""
    prompt = plan.history_tokens + new_tokens
    engine.add_request("t", prompt, greedy(4), initial_state=plan.state, capture_state=True, retain_key=retain)
    out = run_to_end(engine)["t"]
    return manager.finish(plan, prompt, out.token_ids, [{"role": "user", "content": "x"}], out.state)
