"""Garbage collection of the object store's store files by reference (state/bucket_gc.py): the
pieces of a deleted conversation go, those a live conversation shares stay, those of a save whose
manifest is not written yet survive the grace period, a file a new turn names is refreshed, and
one replica sweeps at a time. The replicas share obstore's in-memory store (and moto's S3 once)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_utils import make_engine, random_prompt
from test_conversations import take_turn
from test_object_store import continues_from_its_latest_snapshot, replica

from engram.state.chunks import ORPHAN_GRACE_S
from engram.state.conversations import ConversationManager

pytest.importorskip("obstore")


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return make_engine(checkpoint_dir("nemotron"))


def bucket_files(manager: ConversationManager) -> set[str]:
    """The names (keys) of the KV pieces and checkpoints in the bucket."""
    return {e["path"].rsplit("/", 1)[-1].split(".")[0] for kind in ("kv", "ckpt") for e in manager.store.listing(f".store/{kind}/")}


def files_of(manager: ConversationManager, conversation_id: str) -> set[str]:
    """The store keys the latest turn's manifest names (read from the bucket)."""
    conv = manager.require(conversation_id)
    return manager.store.references(manager.store.locate(conversation_id, "main", conv.latest("main").turn)).keys


def test_the_periodic_sweep_collects_a_deleted_conversations_files_and_keeps_shared_ones(engine, tmp_path):
    """Conversations x and y share their first 16 tokens (one KV piece); x is deleted on replica A, whose
    maintenance sweeps the bucket once due: x's own files go, the shared piece and y's stay (and
    "y" continues exactly on a replica that never held it)."""
    now = [1000.0]
    a = replica(engine, tmp_path / "a", clock=lambda: now[0])
    a.orphan_grace_s = 0.0
    shared = random_prompt(16, 1)
    take_turn(engine, a, "x", shared + random_prompt(6, 2))
    take_turn(engine, a, "x", random_prompt(5, 3))
    take_turn(engine, a, "y", shared + random_prompt(7, 4))
    x_files, y_files = files_of(a, "x"), files_of(a, "y")
    assert x_files & y_files and x_files - y_files and x_files | y_files <= bucket_files(a)
    a.delete_conversation("x")
    now[0] += 61  # the sweep is due, and its minute has passed
    a.maintain()
    left = bucket_files(a)
    assert y_files <= left and not (x_files - y_files) & left
    continues_from_its_latest_snapshot(engine, replica(engine, tmp_path / "c", shared=a), "y")


def test_a_replica_sweeps_by_the_manifests_in_the_bucket_not_by_its_memory(engine, tmp_path):
    """Replica B never read "y": its sweep, knowing no reference of its own, keeps y's files."""
    a = replica(engine, tmp_path / "a")
    take_turn(engine, a, "y", random_prompt(20, 5))
    take_turn(engine, a, "gone", random_prompt(20, 6))
    y_files, gone_files = files_of(a, "y"), files_of(a, "gone")
    a.delete_conversation("gone")
    b = replica(engine, tmp_path / "b", shared=a)
    assert b.store.sweep(set(), 0.0) == len(gone_files)
    assert bucket_files(a) == y_files
    continues_from_its_latest_snapshot(engine, b, "y")


def test_the_files_of_a_save_whose_manifest_is_not_written_yet_survive_the_grace_period(engine, tmp_path):
    """A's turn of "z" has uploaded its files and waits before its manifest; B sweeps meanwhile
    with the grace period: the files nothing names yet are younger than it and stay."""
    a = replica(engine, tmp_path / "a")
    b = replica(engine, tmp_path / "b", shared=a)
    put, entered, go = a.store.put_object, threading.Event(), threading.Event()

    def manifest_waits(key, data, mode="overwrite"):
        if key.startswith("z/") and key.count("/") == 2:
            entered.set()
            go.wait(30)
        return put(key, data, mode)

    a.store.put_object = manifest_waits
    with ThreadPoolExecutor(1) as pool:
        turn = pool.submit(take_turn, engine, a, "z", random_prompt(40, 7))
        try:
            assert entered.wait(30)
            uploaded = bucket_files(a)
            assert len(uploaded) == 4  # pieces [0, 16), [16, 32), [32, 47) and the checkpoint
            assert b.store.sweep(set(), ORPHAN_GRACE_S) == 0
            assert bucket_files(a) == uploaded
        finally:
            go.set()
        turn.result(timeout=30)
    assert files_of(a, "z") == uploaded
    continues_from_its_latest_snapshot(engine, b, "z")


def test_a_turn_refreshes_the_files_it_names_that_the_bucket_got_long_ago(engine, tmp_path):
    """Turn 2 names turn 1's KV pieces without writing them: once the bucket got them longer than
    `refresh_s` ago, the save gives them a new time (same bytes), so that a sweep that listed the
    manifests before turn 2's spares them."""
    a = replica(engine, tmp_path / "a")
    take_turn(engine, a, "r", random_prompt(40, 8))
    pieces = [f".store/kv/{key[:2]}/{key}.safetensors" for key in files_of(a, "r")]
    pieces = [key for key in pieces if key in {e["path"] for e in a.store.listing(".store/kv/")}]
    before = {key: (a.store.head_object(key)["last_modified"], a.store.get_object(key)[0]) for key in pieces}
    take_turn(engine, a, "r", random_prompt(3, 9))  # refresh_s not reached: nothing refreshed
    assert all(a.store.head_object(key)["last_modified"] == before[key][0] for key in pieces)
    a.store.refresh_s = 0.0
    started = time.time()
    take_turn(engine, a, "r", random_prompt(3, 10))
    for key in pieces:
        assert a.store.head_object(key)["last_modified"].timestamp() >= started
        assert a.store.get_object(key)[0] == before[key][1]
    assert not a.store.listing(".store/refresh/")  # the temporary copies are gone


def test_one_replica_sweeps_the_bucket_at_a_time(engine, tmp_path):
    """A holds the lease: B's sweep leaves the bucket alone (its own folder is still swept); once
    the lease is older than its term (A died sweeping), B takes it over."""
    a = replica(engine, tmp_path / "a")
    take_turn(engine, a, "gone", random_prompt(20, 11))
    gone_files = files_of(a, "gone")
    a.delete_conversation("gone")
    assert a.store.sweeper._take_lease(time.time())
    b = replica(engine, tmp_path / "b", shared=a)
    assert b.store.sweep(set(), 0.0) == 0 and gone_files <= bucket_files(a)
    b.store.sweeper.lease_s = 0.0
    assert b.store.sweep(set(), 0.0) == len(gone_files)
    assert not bucket_files(a) and not a.store.listing(".store/sweep-lease.json")


def test_the_bucket_sweep_on_s3(engine, tmp_path, monkeypatch):
    """The same on moto's S3 (conditional puts, copies, listings as S3 answers them): a refreshed
    piece keeps its bytes, a deleted conversation's own files go, a shared one stays."""
    pytest.importorskip("moto.server", reason="needs moto[server]")
    from fleet_utils import S3Server

    server = S3Server()
    server.start()
    try:
        server.create_bucket("engram-gc")
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        a = replica(engine, tmp_path / "a", "s3://engram-gc/p")
        shared = random_prompt(16, 12)
        take_turn(engine, a, "x", shared + random_prompt(6, 13))
        take_turn(engine, a, "y", shared + random_prompt(7, 14))
        a.store.refresh_s = 0.0
        take_turn(engine, a, "y", random_prompt(3, 15))  # refreshes the shared piece
        x_files, y_files = files_of(a, "x"), files_of(a, "y")
        a.delete_conversation("x")
        assert replica(engine, tmp_path / "b", "s3://engram-gc/p").store.sweep(set(), 0.0) == len(x_files - y_files)
        assert bucket_files(a) >= y_files and not (x_files - y_files) & bucket_files(a)
        continues_from_its_latest_snapshot(engine, replica(engine, tmp_path / "c", "s3://engram-gc/p"), "y")
    finally:
        server.stop()
