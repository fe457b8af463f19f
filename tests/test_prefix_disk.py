"""The prefix cache's disk tier: a prompt's state written to the store behind the request is found
again by a new manager over the same folder (a restart), verified, and continues exactly; an
extension writes only its new tokens' KV; sweeps keep what an entry names; kill -9 of a server
mid-write leaves no entry naming a missing file."""

from __future__ import annotations

import math
import os
import signal
import threading

import httpx
import pytest
from engine_utils import greedy, make_engine, random_prompt, run_to_end
from server_utils import ServerProcess
from test_conversations import full_generation
from test_crash_recovery import serve_args
from test_prefix_cache import _resend_history_dialogue
from test_store import _bytes, store_files

from engram.state import chunks
from engram.state.chunks import STORE_NAME
from engram.state.conversations import ConversationManager, SnapshotPolicy
from engram.state.identity import ModelIdentity, tokenizer_fingerprint
from engram.state.store import WarmCache

CHUNK = 16


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return make_engine(checkpoint_dir("nemotron"))


def prefix_manager(engine, root, disk_bytes: int = 1 << 30) -> ConversationManager:
    return ConversationManager(
        engine.spec,
        engine.state_dtypes,
        ModelIdentity.of(engine.spec, engine.model_path),
        tokenizer_fingerprint(engine.model_path),
        SnapshotPolicy(),
        root,
        WarmCache(64, 1 << 30),
        chunk_tokens=CHUNK,
        prefix_cache_bytes=1 << 30,
        prefix_cache_min_tokens=1,
        prefix_cache_disk_bytes=disk_bytes,
    )


def prompt_state(engine, prompt):
    engine.add_request("p", prompt, greedy(1), capture_prompt_state=True)
    return run_to_end(engine)["p"].prompt_state


def test_a_prompt_state_on_disk_survives_a_restart_and_continues_exactly(engine, tmp_path):
    prompt = random_prompt(40, 1)
    before = prefix_manager(engine, tmp_path)
    before.prefix_cache.admit(prompt_state(engine, prompt))
    before.close()
    assert before.prefix_disk.stats.written == 1

    after = prefix_manager(engine, tmp_path)  # memory empty: only the disk has it
    longer = prompt + random_prompt(9, 2)
    state = after.prefix_cache.lookup(longer)
    assert state is not None and state.state_len == len(prompt) and state.tokens == prompt
    assert after.prefix_cache.stats.disk_hits == 1 and len(after.prefix_cache) == 1
    engine.add_request("r", longer, greedy(6), initial_state=state)
    resumed = run_to_end(engine)["r"]
    assert resumed.num_cached_tokens == len(prompt)
    assert resumed.token_ids == full_generation(engine, longer, 6)
    # The state of another prompt is not found for this one.
    assert after.prefix_cache.lookup(random_prompt(50, 3)) is None


def test_an_extended_prompt_writes_only_its_new_tokens_kv_and_a_checkpoint(engine, tmp_path):
    manager = prefix_manager(engine, tmp_path)
    first = random_prompt(40, 4)
    manager.prefix_cache.admit(prompt_state(engine, first))
    manager.prefix_disk.flush()
    written = manager.store.stats.bytes_written
    second = first + random_prompt(24, 5)
    manager.prefix_cache.admit(prompt_state(engine, second))
    manager.prefix_disk.flush()
    new_bytes = manager.store.stats.bytes_written - written
    ideal = 24 * _bytes(engine, 1, kv=True) + _bytes(engine, 0, kv=False)
    assert ideal <= new_bytes <= 1.2 * ideal, (new_bytes, ideal)
    assert len(manager.prefix_disk) == 2


def test_a_sweep_keeps_what_entries_name_and_removes_what_eviction_freed(engine, tmp_path):
    one = prompt_state(engine, random_prompt(40, 6))
    manager = prefix_manager(engine, tmp_path, disk_bytes=one.nbytes + one.nbytes // 2)  # room for one state
    manager.orphan_grace_s = 0.0
    manager.prefix_cache.admit(one)
    manager.prefix_disk.flush()
    files = set(store_files(tmp_path))
    assert manager.sweep_store() == 0 and set(store_files(tmp_path)) == files
    manager.prefix_cache.admit(prompt_state(engine, random_prompt(40, 7)))  # pushes the first out
    manager.prefix_disk.flush()
    assert len(manager.prefix_disk) == 1 and manager.prefix_disk.stats.evicted == 1
    assert manager._sweep_due
    assert manager.sweep_store() == len(files)
    fresh = prefix_manager(engine, tmp_path)
    assert fresh.prefix_cache.lookup(random_prompt(40, 7) + [1]) is not None
    assert fresh.prefix_cache.lookup(random_prompt(40, 6) + [1]) is None


def test_a_damaged_piece_drops_its_entry_and_is_never_loaded(engine, tmp_path):
    prompt = random_prompt(40, 8)
    manager = prefix_manager(engine, tmp_path)
    manager.prefix_cache.admit(prompt_state(engine, prompt))
    manager.close()
    piece = next((tmp_path / STORE_NAME / "kv").glob("*/*"))
    data = bytearray(piece.read_bytes())
    data[-3] ^= 0xFF
    piece.write_bytes(bytes(data))
    after = prefix_manager(engine, tmp_path)
    assert after.prefix_cache.lookup(prompt + [1]) is None
    assert after.prefix_disk.stats.load_failures == 1 and len(after.prefix_disk) == 0
    assert not list((tmp_path / STORE_NAME / "prefix").glob("*.json"))


def test_turn_ends_are_found_by_requests_of_no_conversation(engine, tmp_path):
    from test_conversations import take_turn

    manager = prefix_manager(engine, tmp_path)
    take_turn(engine, manager, "c", random_prompt(30, 9))
    manager.prefix_disk.flush()
    assert manager.prefix_disk.stats.indexed == 1 and manager.prefix_disk.stats.written == 0
    history = manager.snapshot_tokens(manager.snapshots("c")[0])
    fresh = prefix_manager(engine, tmp_path)
    state = fresh.prefix_cache.lookup(history + [5, 6])
    assert state is not None and state.tokens == history[: state.state_len] and state.state_len >= len(history) - 1


def _entries_all_load(engine, root) -> int:
    manager = prefix_manager(engine, root)
    disk = manager.prefix_disk
    keys = list(disk._entries) if len(disk) else []
    for key in keys:
        assert disk.load(key) is not None, key.hex()
    return len(keys)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_restart_and_kill_9_keep_the_resend_history_prefix_exact(engine, checkpoint_dir, tmp_path):
    path = checkpoint_dir("nemotron")
    flags = ("--prefix-cache-min-tokens", "1", "--state-chunk-tokens", str(CHUNK))
    server = ServerProcess(serve_args(path, tmp_path / "on", *flags), tmp_path / "on.log")
    server.start()
    messages: list[dict] = []
    try:
        first = _resend_history_dialogue(server, 2, messages)
        assert server.stop() == 0  # graceful: the writes behind the requests are finished
        server.start()
        after = _resend_history_dialogue(server, 1, messages)  # memory is empty: the previous prompt's state is on disk
        assert after[1][0] >= first[2][1], (first, after)
        stats = httpx.get(server.url + "/v1/state/stats").json()["prefix_cache"]
        assert stats["disk_hits"] == 1 and stats["disk"]["entries"] >= 2, stats
        # kill -9 while requests are being served and their states written
        killer = threading.Timer(0.3 + (os.getpid() % 7) / 20, os.kill, (server.pid, signal.SIGKILL))
        killer.start()
        try:
            for i in range(20):
                httpx.post(
                    server.url + "/generate", timeout=60, json={"input_ids": random_prompt(60 + i, 100 + i), "sampling_params": {"max_new_tokens": 2}}
                )
        except httpx.HTTPError:
            pass
        killer.join()
    finally:
        server.kill()
    assert _entries_all_load(engine, tmp_path / "on") >= 3

    off = ServerProcess(serve_args(path, tmp_path / "off", "--no-enable-prefix-caching"), tmp_path / "off.log")
    off.start()
    try:
        without = _resend_history_dialogue(off, turns=3)
    finally:
        off.kill()
    assert without[1] == [0, 0, 0]
    assert first[0] + after[0] == without[0] and first[2] + after[2] == without[2]


def test_the_disk_tier_evicts_the_state_that_saves_least_compute_per_byte(engine, tmp_path):
    long, short, medium = (prompt_state(engine, random_prompt(n, 20 + n)) for n in (60, 20, 40))
    manager = prefix_manager(engine, tmp_path, disk_bytes=long.nbytes + medium.nbytes + short.nbytes // 2)
    for s in (long, short, medium):  # unrelated prompts: no shared pieces; the long one is the least recently used
        manager.prefix_cache.admit(s)
        manager.prefix_disk.flush()
    assert manager.prefix_disk.stats.evicted == 1
    fresh = prefix_manager(engine, tmp_path)
    found = {n: fresh.prefix_cache.lookup(s.tokens + [1]) is not None for n, s in ((60, long), (20, short), (40, medium))}
    assert found == {60: True, 20: False, 40: True}


def test_a_disk_load_reads_only_the_pieces_memory_does_not_hold(engine, tmp_path, monkeypatch):
    first = random_prompt(40, 30)
    second = first + random_prompt(30, 31)
    before = prefix_manager(engine, tmp_path)
    for prompt in (first, second):
        before.prefix_cache.admit(prompt_state(engine, prompt))
    before.close()
    after = prefix_manager(engine, tmp_path)
    assert after.prefix_cache.lookup(first + [1]).state_len == len(first)  # from disk: now in memory
    read: list[str] = []
    real = chunks.ChunkStore._open
    monkeypatch.setattr(chunks.ChunkStore, "_open", lambda self, path, where: read.append(path.parent.parent.name) or real(self, path, where))
    longer = second + random_prompt(5, 32)
    stats = after.store.stats
    read_before = stats.pieces_read
    state = after.prefix_cache.lookup(longer)
    assert state.state_len == len(second) and state.tokens == second
    # first's pieces (cut at multiples of CHUNK and at its end) come from memory; only those past it are read
    assert stats.pieces_resident == math.ceil(len(first) / CHUNK)
    assert read.count("kv") == stats.pieces_read - read_before == math.ceil((len(second) - len(first)) / CHUNK) + 1
    assert read.count("ckpt") == 1
    engine.add_request("r", longer, greedy(6), initial_state=state)
    assert run_to_end(engine)["r"].token_ids == full_generation(engine, longer, 6)


def test_a_resent_history_adopts_its_slot_without_reading_the_disk(checkpoint_dir, tmp_path):
    """Host memory too small for any state, so the previous turn's prompt state is on disk alone:
    the turn's own slot (the GPU tier) covers more, so the lookup reads nothing (a read of the whole
    history's KV that the engine would then drop for the slot: 227 ms of a turn at 98K on an H200)."""
    from server_utils import metric_value, running_server

    path = checkpoint_dir("nemotron")
    fields = {"prefix_cache_min_tokens": 1, "state_chunk_tokens": CHUNK, "prefix_cache_memory_gb": 1e-6}
    with running_server(path, "m", snapshot_dir=str(tmp_path / "on"), enable_prefix_caching=True, **fields) as srv:
        manager = srv.app.state.serving.conversations.manager
        messages: list[dict] = []
        turns = [_resend_history_dialogue(srv, 1, messages)]
        for _ in range(2):
            manager.prefix_disk.flush()  # the previous prompt's state is on disk before the next turn
            turns.append(_resend_history_dialogue(srv, 1, messages))
        page = httpx.get(srv.url + "/metrics").text
        stats = httpx.get(srv.url + "/v1/state/stats").json()["prefix_cache"]
    assert len(manager.prefix_cache) == 0 and stats["disk"]["entries"] >= 2, stats
    assert metric_value(page, "engram:prefix_cache_slot_hits_total", model_name="m") == 2
    assert stats["disk_hits"] == 0, stats
    replies, cached, prompts = ([t[k][0] for t in turns] for k in range(3))
    assert cached[0] == 0 and all(cached[i] == prompts[i - 1] + 7 for i in (1, 2)), (cached, prompts)
    with running_server(path, "m", snapshot_dir=str(tmp_path / "off"), enable_prefix_caching=False) as srv:
        without = _resend_history_dialogue(srv, 3)
    assert replies == without[0] and prompts == without[2]
