"""State store v2 with a real engine: a turn writes only what is new, forks and conversations share
their prefixes' files, damage is refused where it is, sweeps remove only what nothing references,
v1 files still load."""

from __future__ import annotations

import json
import math

import pytest
import torch
from engine_utils import greedy, make_engine, random_prompt, run_to_end, store_file
from test_conversations import full_generation, take_turn

from engram.state import chunks, manifest
from engram.state.chunks import STORE_NAME
from engram.state.conversations import ConversationManager, SnapshotPolicy
from engram.state.identity import ModelIdentity, tokenizer_fingerprint
from engram.state.sequence_state import SequenceState, expected_tensors, has_non_finite
from engram.state.snapshot import SnapshotMeta, save_snapshot
from engram.state.store import WarmCache

CHUNK = 64


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return make_engine(checkpoint_dir("nemotron"))


def store_manager(engine, root, policy=SnapshotPolicy()) -> ConversationManager:
    return ConversationManager(
        engine.spec,
        engine.state_dtypes,
        ModelIdentity.of(engine.spec, engine.model_path),
        tokenizer_fingerprint(engine.model_path),
        policy,
        root,
        WarmCache(64, 1 << 30),
        chunk_tokens=CHUNK,
    )


def _bytes(engine, state_len: int, kv: bool) -> int:
    return sum(
        dtype.itemsize * _numel(shape)
        for name, (shape, dtype) in expected_tensors(engine.spec, engine.state_dtypes, state_len).items()
        if name.endswith((".k", ".v")) == kv
    )


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def store_files(root) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / STORE_NAME).glob("*/*/*")}


def manifest_of(root, cid, turn, branch="main") -> dict:
    return json.loads((root / cid / branch / f"{turn:06d}.json").read_text())


@pytest.fixture
def written(monkeypatch):
    """Bytes each turn writes: store files and manifests (the conversation record is counted apart)."""
    counts = {"snapshot": 0}
    for module in (chunks, manifest):
        real = module.atomic_write

        def counting(path, data, real=real):
            counts["snapshot"] += len(data)
            real(path, data)

        monkeypatch.setattr(module, "atomic_write", counting)
    return counts


def test_a_turn_writes_only_its_new_tokens_kv_and_its_checkpoint(engine, tmp_path, written):
    manager = store_manager(engine, tmp_path)
    kv_per_token, recurrent = _bytes(engine, 1, kv=True), _bytes(engine, 0, kv=False)
    assert kv_per_token > 0 and recurrent > 0
    previous = 0
    for i in range(8):
        before = written["snapshot"]
        turn = take_turn(engine, manager, "w", random_prompt(66, 100 + i), max_tokens=4)[0]
        new = turn.state_len - previous
        bound = 1.2 * (new * kv_per_token + recurrent)
        assert written["snapshot"] - before <= bound, (i, written["snapshot"] - before, bound)
        previous = turn.state_len
    assert previous > 8 * CHUNK  # the history spans many chunks: a whole-history write would break the bound


def test_a_conversation_occupies_one_copy_of_its_kv_and_its_checkpoints(engine, tmp_path):
    manager = store_manager(engine, tmp_path)
    for i in range(10):
        turn = take_turn(engine, manager, "c", random_prompt(13, 200 + i), max_tokens=3)[0]
    on_disk = sum(store_files(tmp_path).values())
    assert on_disk <= 1.2 * (_bytes(engine, turn.state_len, kv=True) + 10 * _bytes(engine, 0, kv=False))


def test_a_fork_shares_every_piece_before_the_fork_point(engine, tmp_path):
    manager = store_manager(engine, tmp_path)
    for i in range(3):
        take_turn(engine, manager, "f", random_prompt(70, 300 + i), max_tokens=3)
    before = store_files(tmp_path)
    fork = take_turn(engine, manager, "f", random_prompt(5, 310), branch="alt", from_turn=2, max_tokens=3)[0]
    at_two = manifest_of(tmp_path, "f", 2)["store"]["pieces"]
    forked = manifest_of(tmp_path, "f", fork.turn, branch="alt")["store"]["pieces"]
    assert forked[: len(at_two)] == at_two  # the same files, checksums and all
    added = set(store_files(tmp_path)) - set(before)
    assert len(added) == len(forked) - len(at_two) + 1  # its own pieces and its checkpoint, nothing before the fork


def test_two_conversations_with_one_long_system_prompt_share_its_pieces(engine, tmp_path):
    manager = store_manager(engine, tmp_path)
    system = random_prompt(4 * CHUNK + 3, 400)
    take_turn(engine, manager, "a", system + random_prompt(7, 401), max_tokens=3)
    reused = manager.store.stats.files_reused
    take_turn(engine, manager, "b", system + random_prompt(9, 402), max_tokens=3)
    a, b = (manifest_of(tmp_path, cid, 1)["store"]["pieces"] for cid in ("a", "b"))
    assert a[:4] == b[:4] and a[4] != b[4]  # the system prompt's four whole chunks, then their own
    assert manager.store.stats.files_reused - reused == 4


def test_a_damaged_piece_is_refused_and_only_the_turns_holding_it_lose_their_state(engine, tmp_path):
    manager = store_manager(engine, tmp_path)
    for i in range(3):
        take_turn(engine, manager, "d", random_prompt(2 * CHUNK, 500 + i), max_tokens=3)
    one, three = manifest_of(tmp_path, "d", 1), manifest_of(tmp_path, "d", 3)
    second_turns = next(i for i, p in enumerate(three["store"]["pieces"]) if p[0] >= one["state_len"])
    path = store_file(tmp_path / "d" / "main" / "000003.json", piece=second_turns)  # turns 2 and 3 hold it
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = store_manager(engine, tmp_path)
    conv = restarted.require("d")
    history, new = conv.tokens(conv.latest("main")), random_prompt(6, 510)
    turn, out, computed, plan = take_turn(engine, restarted, "d", new, max_tokens=3)
    assert plan.state_tier == "cold" and plan.state.state_len == one["state_len"]  # turn 1's state: it lacks the piece
    assert out.token_ids == full_generation(engine, history + new, max_tokens=3)
    assert sorted(q["ref"] for q in restarted.quarantine.list("d")) == ["main/000002", "main/000003"]
    assert restarted.load_into_warm("d", turn).state_len == turn.state_len  # the new turn wrote the piece again


def test_a_sweep_removes_only_what_no_snapshot_references(engine, tmp_path):
    manager = store_manager(engine, tmp_path)
    system = random_prompt(3 * CHUNK, 600)
    for cid in ("keep", "gone"):
        for i in range(2):
            take_turn(engine, manager, cid, (system if i == 0 else []) + random_prompt(11, hash(cid) % 1000 + i), max_tokens=3)
    referenced = {p[2] for t in (1, 2) for p in manifest_of(tmp_path, "keep", t)["store"]["pieces"]}
    manager.delete_conversation("gone")
    manager.orphan_grace_s = 3600.0
    assert manager.sweep_store() == 0  # every file is recent: a save in flight may reference it
    manager.orphan_grace_s = 0.0
    assert manager.sweep_store() > 0
    left = {name.split(".")[0] for name in store_files(tmp_path)}
    assert referenced <= left
    assert left == {p[2] for t in (1, 2) for p in manifest_of(tmp_path, "keep", t)["store"]["pieces"]} | {
        manifest_of(tmp_path, "keep", t)["store"]["checkpoint"][0] for t in (1, 2)
    }
    restarted = store_manager(engine, tmp_path)
    conv = restarted.require("keep")
    history, new = conv.tokens(conv.latest("main")), random_prompt(5, 610)
    out, plan = take_turn(engine, restarted, "keep", new, max_tokens=3)[1::2]
    assert plan.state_tier == "cold" and out.token_ids == full_generation(engine, history + new, max_tokens=3)


def test_a_v1_snapshot_still_loads_and_the_next_turn_writes_v2(engine, tmp_path):
    manager = store_manager(engine, tmp_path)
    take_turn(engine, manager, "v1", random_prompt(20, 700), max_tokens=3)
    state = manager.warm.peek("v1", "main/000001")
    (tmp_path / "v1" / "main" / "000001.json").unlink()
    save_snapshot(
        tmp_path, state, SnapshotMeta(conversation_id="v1", turn=1), engine.spec, engine.state_dtypes, manager.model, manager.tokenizer_sha256
    )
    restarted = store_manager(engine, tmp_path)
    conv = restarted.require("v1")
    history, new = conv.tokens(conv.latest("main")), random_prompt(6, 701)
    turn, out, computed, plan = take_turn(engine, restarted, "v1", new, max_tokens=3)
    assert plan.state_tier == "cold" and plan.state.state_len == len(history) - 1
    assert out.token_ids == full_generation(engine, history + new, max_tokens=3)
    assert manifest_of(tmp_path, "v1", 2)["format"] == "engram-state/2"
    assert [s["format"] for s in restarted.snapshots("v1")] == ["engram-state/1", "engram-state/2"]


_KILLED_WRITER = """
import random, sys
sys.path[:0] = {paths!r}
from engine_utils import make_engine, random_prompt
from test_conversations import take_turn
from test_store import store_manager
engine = make_engine({model!r})
manager = store_manager(engine, {root!r})
manager.orphan_grace_s = 0.0  # sweep everything unreferenced, at once, while turns are written
rng = random.Random({seed})
system = random_prompt(2 * 64, 900)  # shared by every conversation: its pieces are reused and swept around
for i in range(10_000):
    cid = f"c{{rng.randrange(4)}}"
    if rng.random() < 0.2 and manager.get(cid) is not None:
        manager.delete_conversation(cid)
    else:
        take_turn(engine, manager, cid, (system if manager.get(cid) is None else []) + random_prompt(9, i), max_tokens=2)
    manager.sweep_store()
    print(i, flush=True)
"""


def test_kill_9_during_writes_and_sweeps_leaves_every_listed_turn_loadable(engine, tmp_path, seed=1):
    import os
    import random
    import signal
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    script = _KILLED_WRITER.format(paths=[tests, str(Path(tests).parent / "src")], model=str(engine.model_path), root=str(tmp_path), seed=seed)
    rng = random.Random(seed)
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        target = rng.randrange(3, 12)  # iterations done before the kill lands, somewhere inside the next one
        for line in child.stdout:
            if int(line.split()[0]) >= target:
                break
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    restarted = store_manager(engine, tmp_path)
    listed = restarted.snapshots()
    assert listed
    for entry in listed:
        turn = restarted.require(entry["conversation_id"]).turns[f"{entry['branch']}/{entry['turn']:06d}"]
        restarted.load_into_warm(entry["conversation_id"], turn)  # raises if a piece it names is missing or damaged


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_non_finite_values_are_found_in_every_float_dtype(dtype):
    x = torch.randn(1000).to(dtype)
    x[3], x[4], x[5] = torch.finfo(dtype).max, -torch.finfo(dtype).max, torch.finfo(dtype).tiny
    assert not has_non_finite(x) and not has_non_finite(torch.arange(5))
    for value in (math.inf, -math.inf, math.nan):
        y = x.clone()
        y[500] = value
        assert has_non_finite(y) and has_non_finite(y[400:])


def test_a_state_with_a_non_finite_value_is_not_stored(engine, tmp_path):
    manager = store_manager(engine, tmp_path)
    take_turn(engine, manager, "nan", random_prompt(20, 800), max_tokens=2)
    state = manager.warm.peek("nan", "main/000001")
    k = next(name for name in state.tensors if name.endswith(".k"))
    bad = SequenceState(state.tokens, state.state_len, {**state.tensors, k: state.tensors[k].clone().index_fill_(0, torch.tensor([7]), math.nan)})
    with pytest.raises(ValueError, match="non-finite"):
        store_manager(engine, tmp_path / "empty").store.chunks.save(bad)  # a store without its pieces yet


def test_a_cold_turn_load_takes_the_kv_a_later_warm_turn_holds_instead_of_reading_it(engine, tmp_path, monkeypatch):
    manager = store_manager(engine, tmp_path)
    turns = [take_turn(engine, manager, "c", random_prompt(100, 40 + i))[0] for i in range(3)]
    stats = manager.store.stats
    pieces = len(manager._stored_of("c", turns[0]).pieces)
    assert pieces >= 2
    manager.warm.drop("c", turns[0].ref)  # turn 0 is cold; turn 2, which holds its whole prefix, is warm
    read: list[str] = []
    real = chunks.ChunkStore._open
    monkeypatch.setattr(chunks.ChunkStore, "_open", lambda self, path, where: read.append(path.parent.parent.name) or real(self, path, where))
    before = (stats.pieces_read, stats.pieces_resident)
    state = manager.load_into_warm("c", turns[0])
    assert (stats.pieces_read, stats.pieces_resident) == (before[0], before[1] + pieces)
    assert read == ["ckpt"]
    longer = state.tokens + random_prompt(6, 50)
    engine.add_request("r", longer, greedy(5), initial_state=state)
    assert run_to_end(engine)["r"].token_ids == full_generation(engine, longer, 5)
