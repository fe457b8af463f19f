import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from engram.models.spec import LayerKind, ModelSpec, parse_model_spec
from engram.state import identity, snapshot
from engram.state.identity import ModelIdentity, tokenizer_fingerprint, weights_fingerprint
from engram.state.sequence_state import SequenceState, StateDtypes, expected_tensors
from engram.state.snapshot import (
    InvalidIdError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotIncompatibleError,
    SnapshotMeta,
    SnapshotNotFoundError,
    delete_snapshot,
    list_snapshots,
    load_snapshot,
    read_manifest,
    save_snapshot,
    snapshot_path,
    tensor_checksum,
    validate_id,
)

CONFIG = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hybrid_override_pattern": "M*M",
    "hidden_size": 16,
    "vocab_size": 64,
    "mamba_num_heads": 4,
    "mamba_head_dim": 4,
    "ssm_state_size": 8,
    "n_groups": 2,
    "conv_kernel": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
}
SPEC = parse_model_spec(CONFIG, config_sha256=hashlib.sha256(json.dumps(CONFIG).encode()).hexdigest())
DTYPES = StateDtypes(conv=torch.bfloat16, ssm=torch.float32, kv=torch.bfloat16)
MODEL = ModelIdentity(SPEC.architecture, SPEC.config_sha256, "f" * 64)
TOKENIZER = "7" * 64


def random_state(n_tokens: int = 10, state_len: int | None = None, seed: int = 0, spec: ModelSpec = SPEC) -> SequenceState:
    g = torch.Generator().manual_seed(seed)
    state_len = n_tokens - 1 if state_len is None else state_len
    tokens = torch.randint(0, SPEC.vocab_size, (n_tokens,), generator=g).tolist()
    tensors = {name: torch.randn(shape, generator=g).to(dtype) for name, (shape, dtype) in expected_tensors(spec, DTYPES, state_len).items()}
    return SequenceState(tokens, state_len, tensors)


def save(root: Path, state: SequenceState | None = None, **meta) -> Path:
    meta = {"conversation_id": "conv-1", "turn": 2, "parent": "main/000001", **meta}
    return save_snapshot(root, state or random_state(), SnapshotMeta(**meta), SPEC, DTYPES, MODEL, TOKENIZER)


def load(path: Path, spec=SPEC, dtypes=DTYPES, model=MODEL, tokenizer=TOKENIZER):
    return load_snapshot(path, spec, dtypes, model, tokenizer)


def rewrite(path: Path, edit_tensors=None, **manifest_changes) -> None:
    """Rewrite a snapshot by hand, with a valid checksum over whatever tensors it now holds."""
    tensors = safetensors.torch.load_file(path)
    if edit_tensors:
        edit_tensors(tensors)
    manifest = {**read_manifest(path), **manifest_changes, "checksum": tensor_checksum(tensors)}
    safetensors.torch.save_file(tensors, path, metadata={"engram": json.dumps(manifest)})


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# -- round trip ---------------------------------------------------------------------------------


def test_round_trip_is_bitwise(tmp_path):
    state = random_state()
    meta = SnapshotMeta(conversation_id="conv-1", turn=2, parent="main/000001", extra={"note": "x"})
    path = save_snapshot(tmp_path, state, meta, SPEC, DTYPES, MODEL, TOKENIZER)
    assert path == tmp_path / "conv-1" / "main" / "000002.safetensors"

    loaded, manifest = load(path)
    assert loaded.tokens == state.tokens and loaded.state_len == state.state_len
    assert loaded.tensors.keys() == state.tensors.keys()
    for name, t in state.tensors.items():
        assert loaded.tensors[name].dtype == t.dtype and torch.equal(loaded.tensors[name], t), name
    assert manifest == read_manifest(path)
    assert manifest["format"] == "engram-state/1"
    assert manifest["model"] == dataclasses.asdict(MODEL)
    assert manifest["tokenizer"] == {"sha256": TOKENIZER}
    assert manifest["layout"] == ["mamba", "attention", "mamba"]
    assert manifest["dtypes"] == {"conv": "bfloat16", "ssm": "float32", "kv": "bfloat16"}
    assert (manifest["conversation_id"], manifest["branch"], manifest["turn"]) == ("conv-1", "main", 2)
    assert manifest["parent"] == "main/000001" and manifest["created_at"] == meta.created_at
    assert (manifest["state_len"], manifest["token_count"]) == (9, 10)
    assert manifest["checksum"] == tensor_checksum({**state.tensors, "tokens": torch.tensor(state.tokens, dtype=torch.int32)})
    assert manifest["extra"] == {"note": "x"}


def test_round_trip_with_empty_kv(tmp_path):
    state = random_state(n_tokens=1, state_len=0)
    loaded, _ = load(save(tmp_path, state))
    assert loaded.tensors["layers.1.k"].shape == (0, 2, 4) and loaded.tokens == state.tokens


def test_save_replaces_an_earlier_file_of_the_same_turn(tmp_path):
    save(tmp_path, random_state(seed=1))
    path = save(tmp_path, random_state(seed=2))
    assert load(path)[0].tokens == random_state(seed=2).tokens
    assert files_in(path.parent) == ["000002.safetensors"]


# -- refusals on load ---------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["architecture", "config_sha256", "weights_fingerprint"])
def test_load_refuses_another_model(tmp_path, field):
    other = dataclasses.replace(MODEL, **{field: "other"})
    with pytest.raises(SnapshotIncompatibleError, match=f"different model: {field}"):
        load(save(tmp_path), model=other)


def test_load_refuses_another_tokenizer(tmp_path):
    with pytest.raises(SnapshotIncompatibleError, match="different tokenizer"):
        load(save(tmp_path), tokenizer="0" * 64)


def test_load_refuses_another_layer_layout(tmp_path):
    other = parse_model_spec({**CONFIG, "hybrid_override_pattern": "MM*"}, config_sha256=SPEC.config_sha256)
    with pytest.raises(SnapshotIncompatibleError, match="layer layout"):
        load(save(tmp_path), spec=other)


def test_a_layer_of_two_mixers_round_trips_and_needs_the_state_of_both(tmp_path):
    """Falcon-H1's layout (Mamba2 beside attention in each layer) in the same format: a layout of
    its own, and every layer's conv, SSM and KV required."""
    both = dataclasses.replace(SPEC, layer_mixers=((LayerKind.MAMBA, LayerKind.ATTENTION),) * 3)
    state = random_state(spec=both)
    path = save_snapshot(tmp_path, state, SnapshotMeta(conversation_id="c", turn=1), both, DTYPES, MODEL, TOKENIZER)
    loaded, manifest = load(path, spec=both)
    assert manifest["layout"] == ["mamba+attention"] * 3 and manifest["format"] == "engram-state/1"
    assert all(torch.equal(loaded.tensors[name], t) for name, t in state.tensors.items())
    assert {"layers.1.ssm", "layers.1.k"} <= loaded.tensors.keys()
    with pytest.raises(SnapshotIncompatibleError, match="layer layout"):
        load(path)  # the model of one mixer per layer
    rewrite(path, lambda t: t.pop("layers.1.ssm"))
    with pytest.raises(SnapshotCorruptError, match="lacks tensors: layers.1.ssm"):
        load(path, spec=both)


def test_load_refuses_other_state_dtypes(tmp_path):
    with pytest.raises(SnapshotIncompatibleError, match="ssm is 'float32' in the snapshot, 'bfloat16' here"):
        load(save(tmp_path), dtypes=dataclasses.replace(DTYPES, ssm=torch.bfloat16))


def test_load_refuses_another_format(tmp_path):
    path = save(tmp_path)
    rewrite(path, format="engram-state/2")
    with pytest.raises(SnapshotIncompatibleError, match="format 'engram-state/2'"):
        load(path)


def test_load_refuses_a_missing_file(tmp_path):
    with pytest.raises(SnapshotNotFoundError, match="no snapshot"):
        load(tmp_path / "nope.safetensors")


def test_load_refuses_a_file_without_manifest(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"x": torch.zeros(2)}, path)
    with pytest.raises(SnapshotCorruptError, match="manifest"):
        load(path)


@pytest.mark.parametrize("keep", [lambda n: 4, lambda n: 20, lambda n: n // 2, lambda n: n - 1], ids=["length", "header", "half", "last-byte"])
def test_load_refuses_a_truncated_file(tmp_path, keep):
    path = save(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])
    with pytest.raises(SnapshotCorruptError, match="truncated"):
        load(path)
    with pytest.raises(SnapshotCorruptError, match="truncated"):
        read_manifest(path)


@pytest.mark.parametrize("where", [0.5, 0.9, -1])
def test_load_refuses_a_flipped_byte_in_tensor_data(tmp_path, where):
    path = save(tmp_path)
    data = bytearray(path.read_bytes())
    data_start = 8 + int.from_bytes(data[:8], "little")
    i = len(data) - 1 if where == -1 else data_start + int((len(data) - data_start) * where)
    data[i] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorruptError, match="checksum mismatch"):
        load(path)


def test_load_refuses_a_wrong_shape(tmp_path):
    path = save(tmp_path)
    rewrite(path, lambda t: t.update({"layers.0.ssm": torch.zeros(4, 4, 9)}))
    with pytest.raises(SnapshotCorruptError, match=r"layers.0.ssm has shape \(4, 4, 9\), expected \(4, 4, 8\)"):
        load(path)


def test_load_refuses_a_wrong_dtype(tmp_path):
    path = save(tmp_path)
    rewrite(path, lambda t: t.update({"layers.0.conv": t["layers.0.conv"].float()}))
    with pytest.raises(SnapshotCorruptError, match="layers.0.conv has dtype torch.float32, expected torch.bfloat16"):
        load(path)


def test_load_refuses_non_finite_values(tmp_path):
    path = save(tmp_path)

    def poison(t):
        t["layers.2.ssm"][0, 0, 0] = float("nan")

    rewrite(path, poison)
    with pytest.raises(SnapshotCorruptError, match="layers.2.ssm holds non-finite"):
        load(path)


def test_load_refuses_missing_attention_kv(tmp_path):
    path = save(tmp_path)
    rewrite(path, lambda t: [t.pop("layers.1.k"), t.pop("layers.1.v")])
    with pytest.raises(SnapshotCorruptError, match="lacks tensors: layers.1.k, layers.1.v"):
        load(path)


@pytest.mark.parametrize(
    "changes, message",
    [({"token_count": 11}, "holds 10 ids but token_count is 11"), ({"state_len": 11}, "state_len 11 outside 0..10")],
)
def test_load_refuses_inconsistent_token_counts(tmp_path, changes, message):
    path = save(tmp_path)
    rewrite(path, **changes)
    with pytest.raises(SnapshotCorruptError, match=message):
        load(path)


# -- refusals on save ---------------------------------------------------------------------------


def test_save_refuses_an_incomplete_or_invalid_state(tmp_path):
    state = random_state()
    with pytest.raises(SnapshotError, match="lacks tensors: layers.1.k"):
        save(tmp_path, state.without_attention_kv())
    state.tensors["layers.0.ssm"][0, 0, 0] = float("inf")
    with pytest.raises(SnapshotError, match="non-finite"):
        save(tmp_path, state)
    bad_tokens = random_state()
    bad_tokens.tokens[0] = SPEC.vocab_size
    with pytest.raises(SnapshotError, match="outside the vocabulary"):
        save(tmp_path, bad_tokens)
    assert list_snapshots(tmp_path) == [] and not any(tmp_path.rglob("*.safetensors*"))


# -- ids ----------------------------------------------------------------------------------------

BAD_IDS = [
    "../x",
    "",
    "a" * 129,
    "a/b",
    ".",
    "..",
    "a b",
    "é",
    "a\0b",
    "x\n",
    None,
    7,
    "quarantine.json",
    "conversation.json",
    ".x.tmp-0123456789ab-01234567",
    ".hidden",
]  # a leading dot: the namespace of the folder's own temp files


@pytest.mark.parametrize("bad", BAD_IDS)
def test_bad_ids_are_refused(tmp_path, bad):
    with pytest.raises(InvalidIdError, match="conversation_id"):
        validate_id(bad, "conversation_id")
    with pytest.raises(InvalidIdError, match="branch"):
        snapshot_path(tmp_path, "ok", bad, 1)
    with pytest.raises(InvalidIdError, match="conversation_id"):
        SnapshotMeta(conversation_id=bad, turn=1)
    if bad is not None:  # None lists every conversation
        with pytest.raises(InvalidIdError):
            list_snapshots(tmp_path, bad)


@pytest.mark.parametrize("turn", [0, -1, 1_000_000, True, "1", 1.0])
def test_bad_turns_are_refused(tmp_path, turn):
    with pytest.raises(InvalidIdError, match="turn"):
        snapshot_path(tmp_path, "c", "main", turn)


@pytest.mark.parametrize("parent", ["main", "main/2", "../000001", "./000001", "a/b/000001", "main/٠٠٠٠٠١", ".b/000001"])
def test_bad_parents_are_refused(parent):
    with pytest.raises(InvalidIdError, match="parent"):
        SnapshotMeta(conversation_id="c", turn=2, parent=parent)


def test_good_ids_are_accepted(tmp_path):
    assert validate_id("a" * 128, "x") == "a" * 128
    assert validate_id("legacy.json", "x") == "legacy.json"  # only the folder's own record names are taken
    assert snapshot_path(tmp_path, "Conv_1.x-y", "b.2", 999_999) == tmp_path / "Conv_1.x-y" / "b.2" / "999999.safetensors"


# -- atomic commit ------------------------------------------------------------------------------


@pytest.mark.parametrize("failing", ["fsync", "replace"])
@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_write_leaves_no_trace(tmp_path, monkeypatch, failing, existing):
    folder = tmp_path / "conv-1" / "main"
    folder.mkdir(parents=True)
    before = save(tmp_path, random_state(seed=1)).read_bytes() if existing else None

    def boom(*args, **kwargs):
        raise OSError(f"simulated {failing} failure")

    monkeypatch.setattr(snapshot.os, failing, boom)
    with pytest.raises(OSError, match="simulated"):
        save(tmp_path, random_state(seed=2))
    monkeypatch.undo()
    if existing:
        assert files_in(folder) == ["000002.safetensors"]
        assert (folder / "000002.safetensors").read_bytes() == before
        load(folder / "000002.safetensors")
    else:
        assert files_in(folder) == []


def test_list_ignores_the_temp_file_of_a_killed_writer(tmp_path):
    path = save(tmp_path, turn=1, parent=None)
    (path.parent / ".000002.safetensors.tmp-4242-deadbeef").write_bytes(path.read_bytes()[:100])
    assert [e["path"] for e in list_snapshots(tmp_path)] == [str(path)]


_WRITER = """
import itertools, os, sys, time
sys.path.insert(0, sys.argv[2])
from test_snapshot import save, random_state

real_fsync, committed = os.fsync, 0

def fsync(fd):  # write 16 stalls once its temp file is written, so the kill lands mid-write
    if committed == 15:
        print("stalled", flush=True)
        time.sleep(60)
    real_fsync(fd)

os.fsync = fsync
state = random_state(n_tokens=10_000)
for i in itertools.count():
    save(sys.argv[1], state, conversation_id=f"c{i % 3}", turn=i % 4 + 1, parent=None)
    committed += 1
    print(i, flush=True)
"""


def test_a_writer_killed_mid_way_leaves_only_complete_snapshots(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [child.stdout.readline().strip() for _ in range(16)]
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert lines == [*map(str, range(15)), "stalled"] and child.returncode == -signal.SIGKILL
    assert len(list(tmp_path.glob("c0/main/.000004.safetensors.tmp-*"))) == 1  # the killed write's leftover
    listed = list_snapshots(tmp_path)
    on_disk = sorted(str(p) for p in tmp_path.glob("*/*/[0-9]*.safetensors"))
    assert sorted(e["path"] for e in listed) == on_disk and len(listed) == 12  # 3 conversations x 4 turns
    for entry in listed:
        state, manifest = load(Path(entry["path"]))
        assert manifest == {k: v for k, v in entry.items() if k != "path"} and len(state.tokens) == 10_000


# -- listing and deleting -----------------------------------------------------------------------


def test_list_sorts_filters_and_skips_unreadable_files(tmp_path, caplog):
    for cid, branch, turn in [("b", "main", 1), ("a", "main", 10), ("a", "main", 2), ("a", "alt", 3)]:
        save(tmp_path, conversation_id=cid, branch=branch, turn=turn, parent=None)
    (tmp_path / "a" / "main" / "000005.safetensors").write_bytes(b"garbage")
    keys = [(e["conversation_id"], e["branch"], e["turn"]) for e in list_snapshots(tmp_path)]
    assert keys == [("a", "alt", 3), ("a", "main", 2), ("a", "main", 10), ("b", "main", 1)]
    assert "000005.safetensors" in caplog.text
    assert [e["turn"] for e in list_snapshots(tmp_path, "b")] == [1]
    assert list_snapshots(tmp_path / "missing") == []


def test_delete(tmp_path):
    path = save(tmp_path)
    delete_snapshot(path)
    assert not path.exists() and list_snapshots(tmp_path) == []
    with pytest.raises(SnapshotNotFoundError):
        delete_snapshot(path)


# -- identity -----------------------------------------------------------------------------------


def test_tokenizer_fingerprint_covers_tokenizer_files_and_names(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"vocab": 1}')
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    base = tokenizer_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"unrelated")
    assert tokenizer_fingerprint(tmp_path) == base
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}!")
    changed = tokenizer_fingerprint(tmp_path)
    assert changed != base
    (tmp_path / "chat_template.jinja").rename(tmp_path / "special_tokens_map.json")
    assert tokenizer_fingerprint(tmp_path) not in (base, changed)


def _write_weights(folder: Path, value: float = 0.0) -> Path:
    folder.mkdir(exist_ok=True)
    weights = torch.arange(64 * 1024, dtype=torch.float32)  # 256 KiB of data
    weights[-1] = value
    safetensors.torch.save_file({"w": weights}, folder / "model.safetensors")
    return folder / "model.safetensors"


def test_weights_fingerprint_hashes_small_checkpoints_in_full(tmp_path):
    _write_weights(tmp_path / "a")
    _write_weights(tmp_path / "b", value=1.0)
    assert weights_fingerprint(tmp_path / "a") != weights_fingerprint(tmp_path / "b")
    assert weights_fingerprint(tmp_path / "a") == weights_fingerprint(tmp_path / "a")
    with pytest.raises(FileNotFoundError):
        weights_fingerprint(tmp_path)


def test_weights_fingerprint_samples_large_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "FULL_HASH_LIMIT", 0)
    monkeypatch.setattr(identity, "SAMPLE_SIZE", 1024)
    monkeypatch.setattr(identity, "SAMPLES_PER_FILE", 4)
    a = _write_weights(tmp_path / "a")
    _write_weights(tmp_path / "b", value=1.0)  # the last byte lies in the last sample
    assert weights_fingerprint(tmp_path / "a") != weights_fingerprint(tmp_path / "b")
    data = bytearray(a.read_bytes())
    data[len(data) // 2 + 100] ^= 0xFF  # between samples: not seen, by design
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "model.safetensors").write_bytes(bytes(data))
    assert weights_fingerprint(tmp_path / "c") == weights_fingerprint(tmp_path / "a")


def test_model_identity_of_a_checkpoint(tmp_path):
    _write_weights(tmp_path)
    ident = ModelIdentity.of(SPEC, tmp_path)
    assert ident == ModelIdentity(SPEC.architecture, SPEC.config_sha256, weights_fingerprint(tmp_path))
