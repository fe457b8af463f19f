"""The COLD tier behind one interface: `ColdStore` is what the conversation manager asks of durable
storage for turn states and conversation records; `FilesystemColdStore` is the snapshot folder's
(v2 manifests over the `ChunkStore`, v1 files read, records by `RecordFiles`), and
state/object_store.py's puts a bucket behind it.

A turn's snapshot is found by `locate` (a string: here a path; an object store would use a key) and
every listing and manifest carries it as "path". A backend keeps the guarantees in
docs/ARCHITECTURE.md ("Adding a storage backend"): whole files or none, store files before the
manifest that names them, and a sweep that spares files touched within its grace period.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import IO, Any, Protocol

from engram.models.spec import ModelSpec
from engram.state.chunks import ChunkStore, PrefixHasher, StoredState, StoreStats
from engram.state.identity import ModelIdentity
from engram.state.manifest import load_turn, save_turn, stored_state, turn_file, turn_tokens
from engram.state.records import RecordFiles
from engram.state.sequence_state import SequenceState, StateDtypes
from engram.state.snapshot import (
    SnapshotMeta,
    atomic_write,
    check_no_links,
    delete_snapshot,
    is_stale_temp_file,
    list_snapshots,
    read_manifest,
    read_no_follow,
    snapshot_label,
)
from engram.state.staging import DeviceStaging

PREFIX_NAME = "prefix"  # <root>/.store/prefix/<key>.json: the prefix cache's entries on disk


class ColdStore(Protocol):
    """Durable turn states: save, load, delete, list, sweep (and what export/import move)."""

    stats: StoreStats

    def locate(self, conversation_id: str, branch: str, turn: int, fmt: str | None = None) -> str:
        """Where the turn's snapshot is (or would be written); `fmt` ("json": v2, "safetensors":
        v1) picks one format's place, else whichever the turn has (v2 if neither)."""
        ...

    def exists(self, location: str) -> bool: ...

    def save(self, state: SequenceState, meta: SnapshotMeta, base: StoredState | None) -> StoredState:
        """Store what `base` lacks of the state, then commit the turn's manifest."""
        ...

    def load(
        self, location: str, resident: SequenceState | None = None, staging: DeviceStaging | None = None
    ) -> tuple[SequenceState, dict[str, Any]]:
        """The verified state and its manifest (SnapshotError subclasses say what failed); the KV
        pieces whose prefix `resident` (a state in memory) holds are taken from it, not read.
        `staging`: copy the state to a device as it is read (state/staging.py; v2 only)."""
        ...

    def manifest(self, location: str) -> dict[str, Any]: ...

    def references(self, location: str) -> StoredState | None:
        """The store files the snapshot names (None: a v1 file, which names none)."""
        ...

    def tokens(self, manifest: dict[str, Any]) -> list[int]:
        """The token ids a snapshot covers, read without its state tensors."""
        ...

    def delete(self, location: str) -> None:
        """Delete the snapshot (SnapshotNotFoundError if there is none); its store files stay until a sweep."""
        ...

    def snapshots(self, conversation_id: str) -> list[dict[str, Any]]:
        """The manifest (with "path") of every readable snapshot the conversation has stored."""
        ...

    def written_within(self, location: str, seconds: float) -> bool:
        """Whether a snapshot that no record lists may be another process's turn whose record is
        not written yet (stored in the last `seconds`), rather than a crash's leftover."""
        ...

    def sweep(self, referenced: set[str], grace_s: float) -> int:
        """Delete the store files no key in `referenced` names, sparing those touched within `grace_s`."""
        ...

    def read(self, location: str) -> bytes: ...

    def write(self, location: str, data: bytes) -> None: ...

    def store_members(self, stored: StoredState) -> dict[str, str]:
        """Export member name -> the store file that holds it."""
        ...

    def adopt(self, kind: str, key: str, stream: IO[bytes]) -> None:
        """Store an imported store file under its key (verified when a manifest naming it is loaded)."""
        ...

    # The prefix cache's disk tier (state/prefix_disk.py): states stored without a turn, and a
    # small entry per state naming its store references. Entries are whole or absent, and are
    # written after the files they name.

    def save_state(self, state: SequenceState, base: StoredState | None) -> StoredState:
        """Store what `base` lacks of the state; no manifest."""
        ...

    def load_state(self, stored: StoredState, resident: SequenceState | None = None, staging: DeviceStaging | None = None) -> SequenceState:
        """The verified state `stored` names (SnapshotError subclasses say what failed); the KV
        pieces whose prefix `resident` (a state in memory) holds are taken from it, not read.
        `staging`: copy the state to a device as it is read, as `load`'s."""
        ...

    def prefix_entries(self) -> dict[str, bytes]:
        """Every prefix entry: name -> its bytes."""
        ...

    def put_prefix_entry(self, name: str, data: bytes) -> None: ...

    def drop_prefix_entry(self, name: str) -> None:
        """Delete the entry (none: nothing to do); the store files it names stay until a sweep."""
        ...

    # Conversation records (state/turns.py), one per conversation. A store that other processes
    # write too (object_store.py) writes one only over the version this process last read or
    # wrote, and raises StaleViewError otherwise.

    def read_record(self, conversation_id: str) -> bytes | None:
        """The conversation's record (None: it has none)."""
        ...

    def write_record(self, conversation_id: str, data: bytes) -> None: ...

    def delete_record(self, conversation_id: str) -> None:
        """Delete the record (none: nothing to do)."""
        ...

    def record_ids(self) -> list[str]:
        """The conversations that may have a record (a listing: `read_record` says for sure)."""
        ...

    def record_current(self, conversation_id: str) -> bool:
        """Whether the record is still the version this process last read or wrote (always, for a
        store no other process writes)."""
        ...


class FilesystemColdStore:
    """`<root>/<conversation>/<branch>/<turn:06d>.json` manifests over `<root>/.store/` (ChunkStore)."""

    def __init__(self, root: Path, spec: ModelSpec, dtypes: StateDtypes, hasher: PrefixHasher, model: ModelIdentity, tokenizer_sha256: str):
        self.root = root
        self.chunks = ChunkStore(root, spec, dtypes, hasher)
        self.records = RecordFiles(root)
        self.stats = self.chunks.stats
        self.spec, self.dtypes, self.model, self.tokenizer_sha256 = spec, dtypes, model, tokenizer_sha256

    def locate(self, conversation_id: str, branch: str, turn: int, fmt: str | None = None) -> str:
        path = turn_file(self.root, conversation_id, branch, turn)
        return str(path if fmt is None else path.with_suffix("." + fmt))

    def exists(self, location: str) -> bool:
        return Path(location).is_file()

    def save(self, state: SequenceState, meta: SnapshotMeta, base: StoredState | None) -> StoredState:
        return save_turn(self.chunks, state, meta, self.model, self.tokenizer_sha256, base)[1]

    def load(
        self, location: str, resident: SequenceState | None = None, staging: DeviceStaging | None = None
    ) -> tuple[SequenceState, dict[str, Any]]:
        return load_turn(self.chunks, Path(location), self.spec, self.dtypes, self.model, self.tokenizer_sha256, resident, staging)

    def manifest(self, location: str) -> dict[str, Any]:
        return read_manifest(location)

    def references(self, location: str) -> StoredState | None:
        return stored_state(read_manifest(location), snapshot_label(location))

    def tokens(self, manifest: dict[str, Any]) -> list[int]:
        return turn_tokens(self.chunks, Path(manifest["path"]), manifest)

    def delete(self, location: str) -> None:
        delete_snapshot(location)

    def snapshots(self, conversation_id: str) -> list[dict[str, Any]]:
        return list_snapshots(self.root, conversation_id)

    def written_within(self, location: str, seconds: float) -> bool:
        return False  # the folder is this process's alone: one it did not record is left by a crash

    def sweep(self, referenced: set[str], grace_s: float) -> int:
        return self.chunks.sweep(referenced, grace_s)

    def read(self, location: str) -> bytes:
        return bytes(read_no_follow(Path(location)))

    def write(self, location: str, data: bytes) -> None:
        atomic_write(Path(location), data)

    def store_members(self, stored: StoredState) -> dict[str, str]:
        members = {f"store/kv/{p.key}.safetensors": str(self.chunks.piece_path(p.key)) for p in stored.pieces}
        members[f"store/ckpt/{stored.checkpoint}.safetensors"] = str(self.chunks.checkpoint_path(stored.checkpoint))
        return members

    def adopt(self, kind: str, key: str, stream: IO[bytes]) -> None:
        self.chunks.adopt_file(kind, key, stream)

    def save_state(self, state: SequenceState, base: StoredState | None) -> StoredState:
        return self.chunks.save(state, base)

    def load_state(self, stored: StoredState, resident: SequenceState | None = None, staging: DeviceStaging | None = None) -> SequenceState:
        return self.chunks.load(stored, resident=resident, staging=staging)

    def _prefix_entry(self, name: str) -> Path:
        if not name.isalnum():
            raise ValueError(f"malformed prefix entry name {name!r:.80}")
        return check_no_links(self.root, self.chunks.dir / PREFIX_NAME / f"{name}.json")

    def prefix_entries(self) -> dict[str, bytes]:
        folder = self.chunks.dir / PREFIX_NAME
        entries = {}
        for path in sorted(folder.iterdir()) if folder.is_dir() else ():
            with contextlib.suppress(FileNotFoundError):  # dropped meanwhile
                if is_stale_temp_file(path):  # a write that a crash cut short
                    path.unlink()
                elif path.suffix == ".json":
                    entries[path.stem] = bytes(read_no_follow(self._prefix_entry(path.stem)))
        return entries

    def put_prefix_entry(self, name: str, data: bytes) -> None:
        atomic_write(self._prefix_entry(name), data)

    def drop_prefix_entry(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._prefix_entry(name).unlink()

    def read_record(self, conversation_id: str) -> bytes | None:
        return self.records.read(conversation_id)

    def write_record(self, conversation_id: str, data: bytes) -> None:
        self.records.write(conversation_id, data)

    def delete_record(self, conversation_id: str) -> None:
        self.records.delete(conversation_id)

    def record_ids(self) -> list[str]:
        return self.records.ids()

    def record_current(self, conversation_id: str) -> bool:
        return True
