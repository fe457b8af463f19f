"""Cold restores that read only what memory lacks and copy to the device while they read
(state/staging.py): exact, refusing damage, and overlapped (a slow reader's last piece is still
being read when the first copies are issued)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_utils import greedy, make_engine, random_prompt, run_to_end, store_file
from test_conversations import full_generation, take_turn
from test_prefix_disk import prefix_manager, prompt_state
from test_store import CHUNK, manifest_of, store_manager

from engram.state import chunks
from engram.state.host_arena import ALIGN, HostArena
from engram.state.snapshot import SnapshotCorruptError
from engram.state.staging import DeviceStaging


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    """On the CPU in float32 wherever the tests run: the CPU stands in for the device, and the
    continuations are compared with a full prefill exactly (an H200 run in bf16 failed 4 of these)."""
    return make_engine(checkpoint_dir("nemotron"), device="cpu", dtype="float32")


@pytest.fixture
def staging_engine(engine, monkeypatch):
    """The CPU engine taking staged states as a GPU engine does (its "device" is the CPU)."""
    monkeypatch.setattr(type(engine), "restore_device", property(lambda self: self.device))
    return engine


def with_arena(manager, device: torch.device, nbytes: int = 1 << 26):
    """The manager staging its cold loads on `device`, into an arena as a server's does (pinned on CUDA)."""
    manager.staging_device = device
    manager.host_arena = HostArena(nbytes, pin=device.type == "cuda")
    return manager


def assert_continues_exactly(engine, state, seed: int) -> None:
    """The state restored and continued by 5 new tokens generates what a full prefill of them does."""
    longer = state.tokens + random_prompt(5, seed)
    engine.add_request("r", longer, greedy(4), initial_state=state)
    assert run_to_end(engine)["r"].token_ids == full_generation(engine, longer, 4)


def three_turns(engine, manager, cid: str = "s") -> list:
    return [take_turn(engine, manager, cid, random_prompt(2 * CHUNK, 50 + i), max_tokens=3)[0] for i in range(3)]


def store_file_sizes(root, cid: str, turn: int, pieces: slice) -> int:
    refs = manifest_of(root, cid, turn)["store"]["pieces"]
    manifest = root / cid / "main" / f"{turn:06d}.json"
    return sum(store_file(manifest, piece=i).stat().st_size for i in range(len(refs))[pieces]) + store_file(manifest).stat().st_size


def test_a_cold_load_takes_the_kv_another_conversations_warm_state_holds(engine, tmp_path):
    manager = store_manager(engine, tmp_path)
    system = random_prompt(4 * CHUNK + 3, 20)
    take_turn(engine, manager, "a", system + random_prompt(7, 21), max_tokens=3)
    b = take_turn(engine, manager, "b", system + random_prompt(CHUNK + 9, 22), max_tokens=3)[0]
    manager.warm.drop("b", b.ref)  # b is cold; a, warm, holds the system prompt's four whole chunks
    stats = manager.store.stats
    before = (stats.bytes_read, stats.pieces_resident)
    state = manager.load_into_warm("b", b)
    assert stats.pieces_resident - before[1] == 4
    assert stats.bytes_read - before[0] == store_file_sizes(tmp_path, "b", 1, slice(4, None))  # b's own pieces and checkpoint only
    assert_continues_exactly(engine, state, seed=23)


def test_a_staged_load_equals_the_plain_one_and_restores_exactly(staging_engine, tmp_path):
    engine = staging_engine
    manager = store_manager(engine, tmp_path)
    turns = three_turns(engine, manager)
    stored = manager._stored_of("s", turns[2])
    store = manager.store.chunks
    plain = store.load(stored)
    staging = DeviceStaging(torch.device("cpu"))
    read, resident = store.stats.pieces_read, store.stats.pieces_resident
    host = store.load(stored, resident=manager.warm.peek("s", turns[0].ref), staging=staging)
    assert store.stats.pieces_read > read and store.stats.pieces_resident > resident  # pieces from memory and from disk
    staged = staging.state
    assert staged is not None
    for name, t in plain.flat_tensors().items():
        assert torch.equal(staged.tensors[name], t) and torch.equal(host.flat_tensors()[name], t), name
    longer = plain.tokens + random_prompt(6, 60)
    engine.add_request("r", longer, greedy(5), initial_state=host, staged=staging)
    assert staging.take() is None  # the engine took it
    assert run_to_end(engine)["r"].token_ids == full_generation(engine, longer, 5)


def test_the_engine_refuses_a_staged_state_that_is_not_its_initial_state(staging_engine, tmp_path):
    engine = staging_engine
    manager = store_manager(engine, tmp_path)
    turns = three_turns(engine, manager)
    store = manager.store.chunks
    staging = DeviceStaging(torch.device("cpu"))
    store.load(manager._stored_of("s", turns[1]), staging=staging)
    first = store.load(manager._stored_of("s", turns[0]))
    with pytest.raises(ValueError, match="staged: its state does not hold initial_state's tokens"):
        engine.add_request("bad", first.tokens + [1, 2], greedy(2), initial_state=first, staged=staging)


def test_an_engine_without_a_restore_device_refuses_a_staged_state(engine, tmp_path):
    manager = store_manager(engine, tmp_path)
    turns = three_turns(engine, manager)
    staging = DeviceStaging(torch.device("cpu"))
    state = manager.store.chunks.load(manager._stored_of("s", turns[0]), staging=staging)
    assert engine.restore_device is None  # the CPU's
    with pytest.raises(ValueError, match="staged: its state must be on the restore device"):
        engine.add_request("bad", state.tokens + [1, 2], greedy(2), initial_state=state, staged=staging)


def test_copies_start_before_the_last_piece_is_read(engine, tmp_path, monkeypatch):
    manager = store_manager(engine, tmp_path)
    turns = three_turns(engine, manager)
    stored = manager._stored_of("s", turns[2])
    last = stored.pieces[-1].key
    events: list[str] = []
    lock = threading.Lock()
    real = chunks.ChunkStore._open

    def slow_open(self, path, where):
        time.sleep(0.3 if path.name.startswith(last) else 0.01)
        with lock:
            events.append(f"read {path.name[:8]}")
        return real(self, path, where)

    class Spy(DeviceStaging):
        def kv(self, start, tensors):
            events.append(f"copy {start}")
            super().kv(start, tensors)

    monkeypatch.setattr(chunks.ChunkStore, "_open", slow_open)
    staging = Spy(torch.device("cpu"))
    host = manager.store.chunks.load(stored, staging=staging)
    copies = [i for i, e in enumerate(events) if e.startswith("copy")]
    assert len(copies) == len(stored.pieces) >= 4
    assert copies[0] < events.index(f"read {last[:8]}")  # the first copy went out while the last piece was still being read
    assert staging.state is not None
    assert all(torch.equal(staging.state.tensors[n], t) for n, t in host.flat_tensors().items())


def test_a_damaged_piece_is_refused_and_nothing_of_it_is_staged(staging_engine, tmp_path):
    engine = staging_engine
    manager = store_manager(engine, tmp_path)
    turns = three_turns(engine, manager, "d")
    one = manifest_of(tmp_path, "d", 1)
    later = next(i for i, p in enumerate(manifest_of(tmp_path, "d", 3)["store"]["pieces"]) if p[0] >= one["state_len"])
    path = store_file(tmp_path / "d" / "main" / "000003.json", piece=later)  # turns 2 and 3 hold it
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF
    path.write_bytes(bytes(data))
    staging = DeviceStaging(torch.device("cpu"))
    with pytest.raises(SnapshotCorruptError, match="checksum mismatch"):
        manager.store.chunks.load(manager._stored_of("d", turns[2]), staging=staging)
    assert staging.state is None and not path.exists()  # set aside
    path.write_bytes(bytes(data))  # damaged again, for a restarted manager that stages its loads
    restarted = store_manager(engine, tmp_path)
    restarted.staging_device = torch.device("cpu")
    conv = restarted.require("d")
    history, new = conv.tokens(conv.latest("main")), random_prompt(6, 70)
    plan = restarted.begin("d")
    assert plan.state_tier == "cold" and plan.state is not None and plan.state.state_len == one["state_len"]  # turn 1's: it lacks the piece
    assert plan.staging is not None and plan.staging.state is not None and plan.staging.state.state_len == plan.state.state_len
    assert sorted(q["ref"] for q in restarted.quarantine.list("d")) == ["main/000002", "main/000003"]
    prompt = plan.history_tokens + new
    engine.add_request("t", prompt, greedy(3), initial_state=plan.state, staged=plan.staging)
    out = run_to_end(engine)["t"]
    restarted.release("d")
    assert out.token_ids == full_generation(engine, history + new, max_tokens=3)


def test_a_cold_load_after_a_restart_reads_into_the_arena_which_the_warm_tier_counts(staging_engine, tmp_path):
    engine = staging_engine
    three_turns(engine, store_manager(engine, tmp_path))
    restarted = with_arena(store_manager(engine, tmp_path), torch.device("cpu"))
    arena = restarted.host_arena
    conv = restarted.require("s")
    history, new = conv.tokens(conv.latest("main")), random_prompt(6, 80)
    plan = restarted.begin("s")
    assert plan.state_tier == "cold" and plan.staging is not None and plan.staging.state is not None
    assert all(arena.holds(t) for t in plan.state.all_tensors())
    blocks = sum(-(-t.nbytes // ALIGN) * ALIGN for t in plan.state.all_tensors())
    assert restarted.warm.nbytes == arena.used == blocks  # each block counted once, at its true size
    engine.add_request("t", plan.history_tokens + new, greedy(4), initial_state=plan.state, staged=plan.staging)
    out = run_to_end(engine)["t"]
    restarted.release("s")
    assert out.token_ids == full_generation(engine, history + new, max_tokens=4)
    restarted.warm.drop("s")
    del plan
    assert arena.used == 0  # the state left memory: its blocks are free again


def test_a_load_into_warm_that_no_request_waits_for_reads_into_the_arena_and_stages_nothing(staging_engine, tmp_path, monkeypatch):
    engine = staging_engine
    three_turns(engine, store_manager(engine, tmp_path))
    restarted = with_arena(store_manager(engine, tmp_path), torch.device("cpu"))
    for copy in ("kv", "recurrent"):
        monkeypatch.setattr(DeviceStaging, copy, lambda self, *args: pytest.fail("a state no request waits for was copied to the device"))
    conv = restarted.require("s")
    state = restarted.load_into_warm("s", conv.latest("main"))  # as /restore_snapshot and the start-up preload do
    assert restarted.warm.peek("s", conv.latest("main").ref) is state
    assert all(restarted.host_arena.holds(t) for t in state.all_tensors())
    assert_continues_exactly(engine, state, seed=85)


def test_a_load_the_arena_cannot_hold_reads_into_memory_of_its_own(staging_engine, tmp_path):
    engine = staging_engine
    manager = store_manager(engine, tmp_path)
    stored = manager._stored_of("s", three_turns(engine, manager)[2])
    plain = manager.store.chunks.load(stored)
    arena = HostArena(ALIGN, pin=False)  # smaller than any KV tensor of the state
    staging = DeviceStaging(torch.device("cpu"), arena=arena)
    host = manager.store.chunks.load(stored, staging=staging)
    assert arena.misses > 0 and not any(arena.holds(t) for name, t in host.flat_tensors().items() if name.endswith((".k", ".v")))
    assert staging.state is not None
    for name, t in plain.flat_tensors().items():
        assert torch.equal(host.flat_tensors()[name], t) and torch.equal(staging.state.tensors[name], t), name


def test_a_prefix_cache_hit_read_from_disk_is_staged_and_continues_exactly(staging_engine, tmp_path):
    engine = staging_engine
    prompt = random_prompt(40, 1)
    before = prefix_manager(engine, tmp_path)
    before.prefix_cache.admit(prompt_state(engine, prompt))
    before.close()
    after = with_arena(prefix_manager(engine, tmp_path), torch.device("cpu"))  # a restart: only the disk has it
    staging = after.new_staging()
    longer = prompt + random_prompt(9, 2)
    state = after.prefix_cache.lookup(longer, staging)
    assert state is not None and state.state_len == len(prompt) and after.prefix_cache.stats.disk_hits == 1
    assert staging is not None and staging.state is not None and all(after.host_arena.holds(t) for t in state.all_tensors())
    for name, t in state.flat_tensors().items():
        assert torch.equal(staging.state.tensors[name], t), name
    engine.add_request("r", longer, greedy(6), initial_state=state, staged=staging)
    assert staging.take() is None  # the engine took it
    assert run_to_end(engine)["r"].token_ids == full_generation(engine, longer, 6)
    again = after.new_staging()
    assert after.prefix_cache.lookup(longer, again) is state and again is not None and again.state is None  # a memory hit stages nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_load_staged_on_the_gpu_reads_into_pinned_memory_and_equals_the_host_state(engine, tmp_path):
    manager = store_manager(engine, tmp_path)
    turns = three_turns(engine, manager)
    stored = manager._stored_of("s", turns[2])
    staging = DeviceStaging(torch.device("cuda"))
    host = manager.store.chunks.load(stored, staging=staging)
    staged = staging.take()
    assert staged is not None and staged.ready is not None
    staged.wait()
    assert all(t.is_pinned() for t in host.all_tensors())
    for name, t in host.flat_tensors().items():
        assert torch.equal(staged.tensors[name].cpu(), t), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_turn_restored_from_a_staged_load_after_a_restart_equals_a_full_prefill_on_the_gpu(checkpoint_dir, tmp_path):
    engine = make_engine(checkpoint_dir("nemotron"), device="cuda", dtype="float32", max_running_requests=2)
    assert engine.restore_device is not None and engine.restore_device.type == "cuda"
    manager = store_manager(engine, tmp_path)
    three_turns(engine, manager)
    restarted = with_arena(store_manager(engine, tmp_path), engine.restore_device)
    conv = restarted.require("s")
    history, new = conv.tokens(conv.latest("main")), random_prompt(6, 90)
    plan = restarted.begin("s")
    assert plan.state_tier == "cold" and plan.staging is not None and plan.staging.state is not None
    # the WARM copy: read into the arena, page-locked at its start, so a later restore from it does not wait on pageable memory
    assert all(t.is_pinned() and restarted.host_arena.holds(t) for t in plan.state.all_tensors())
    engine.add_request("t", plan.history_tokens + new, greedy(6), initial_state=plan.state, staged=plan.staging)
    out = run_to_end(engine)["t"]
    restarted.release("s")
    assert plan.staging.state is None  # taken by the engine, dropped after the restore
    assert out.token_ids == full_generation(engine, history + new, max_tokens=6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_load_staged_on_the_gpu_past_a_full_arena_still_leaves_a_pinned_warm_copy(engine, tmp_path):
    manager = store_manager(engine, tmp_path)
    stored = manager._stored_of("s", three_turns(engine, manager)[2])
    arena = HostArena(ALIGN, pin=True)
    staging = DeviceStaging(torch.device("cuda"), arena=arena)
    host = manager.store.chunks.load(stored, staging=staging)
    assert arena.misses > 0 and all(t.is_pinned() for t in host.all_tensors())
