"""A turn's snapshot in format v2: a small JSON manifest over the chunk store (state/chunks.py).

    <root>/<conversation_id>/<branch>/<turn:06d>.json

It holds v1's manifest fields (format "engram-state/2", identity, layout, dtypes, conversation,
branch, turn, parent, state_len, token_count, checksum), the store references of the turn's
state (`store`: its KV pieces and checkpoint, each with its checksum) and the tokens past
`state_len` (`tail_tokens`; the pieces hold the rest). v1 files (one safetensors file per turn)
stay readable: `turn_file` finds whichever a turn has, `load_turn` loads either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engram.models.spec import ModelSpec
from engram.state.chunks import ChunkStore, StoredState
from engram.state.identity import ModelIdentity
from engram.state.sequence_state import SequenceState, StateDtypes
from engram.state.snapshot import (
    SnapshotCorruptError,
    SnapshotError,
    SnapshotMeta,
    atomic_write,
    check_compatible,
    check_no_links,
    load_snapshot,
    manifest_fields,
    read_manifest,
    read_tokens,
    snapshot_label,
    snapshot_path,
)
from engram.state.staging import DeviceStaging

FORMAT_V2 = "engram-state/2"


def manifest_path(root: Path, conversation_id: str, branch: str, turn: int) -> Path:
    return check_no_links(root, snapshot_path(root, conversation_id, branch, turn).with_suffix(".json"))


def turn_file(root: Path, conversation_id: str, branch: str, turn: int) -> Path:
    """The turn's v2 manifest, or its v1 file where only that exists (the v2 path if neither does)."""
    v2 = manifest_path(root, conversation_id, branch, turn)
    v1 = snapshot_path(root, conversation_id, branch, turn)
    return v1 if not v2.exists() and v1.exists() else v2


def save_turn(
    store: ChunkStore, state: SequenceState, meta: SnapshotMeta, model: ModelIdentity, tokenizer_sha256: str, base: StoredState | None
) -> tuple[dict[str, Any], StoredState]:
    """Store the state (only what the store lacks) and then commit the turn's manifest, atomically."""
    state.wait()
    try:
        stored = store.save(state, base)
    except (ValueError, RuntimeError, KeyError, IndexError) as e:  # a state that is not this model's, or a damaged base
        raise SnapshotError(f"refusing to save an invalid state: {e!r}") from e
    manifest = {
        **manifest_fields(FORMAT_V2, state, meta, store.spec, store.dtypes, model, tokenizer_sha256, stored.digest),
        "chunk_tokens": store.hasher.chunk_tokens,
        "store": stored.to_json(),
        "tail_tokens": list(state.tokens[state.state_len :]),
    }
    path = manifest_path(store.root, meta.conversation_id, meta.branch, meta.turn)
    atomic_write(path, json.dumps(manifest, sort_keys=True, allow_nan=False).encode())
    return manifest, stored


def stored_state(manifest: dict[str, Any], where: str) -> StoredState | None:
    """The store references of a v2 manifest (None for a v1 file's)."""
    if manifest.get("format") != FORMAT_V2:
        return None
    try:
        return StoredState.from_json(manifest["store"])
    except (KeyError, SnapshotCorruptError) as e:
        raise SnapshotCorruptError(f"{where}: {e}") from e


def load_turn(
    store: ChunkStore,
    path: Path,
    spec: ModelSpec,
    dtypes: StateDtypes,
    model: ModelIdentity,
    tokenizer_sha256: str,
    resident: SequenceState | None = None,
    staging: DeviceStaging | None = None,
) -> tuple[SequenceState, dict[str, Any]]:
    """Load and verify a turn's state from its v2 manifest or v1 file (see `ChunkStore.load`;
    `resident` lends the KV pieces it holds and `staging` copies it to a device, v2 only)."""
    if path.suffix != ".json":
        return load_snapshot(path, spec, dtypes, model, tokenizer_sha256)
    where = snapshot_label(path)
    manifest = read_manifest(path)
    check_compatible(manifest, where, spec, dtypes, model, tokenizer_sha256, fmt=FORMAT_V2)
    stored = stored_state(manifest, where)
    assert stored is not None
    tail = manifest.get("tail_tokens")
    if not isinstance(tail, list) or stored.state_len != manifest.get("state_len") or stored.digest != manifest.get("checksum"):
        raise SnapshotCorruptError(f"{where}: the manifest's state_len, checksum or tail tokens do not agree with its store references")
    try:
        state = store.load(stored, tail, resident, staging)
    except SnapshotError as e:
        raise type(e)(f"{where}: {e}") from e
    if len(state.tokens) != manifest.get("token_count") or any(not 0 <= t < spec.vocab_size for t in tail):
        raise SnapshotCorruptError(f"{where}: token_count or tail tokens do not match the stored state")
    return state, manifest


def turn_tokens(store: ChunkStore, path: Path, manifest: dict[str, Any]) -> list[int]:
    """The token ids a turn's snapshot covers (its `fill_ids`), read without the state tensors."""
    stored = stored_state(manifest, snapshot_label(path))
    if stored is None:
        return read_tokens(path)
    return store.read_tokens(stored) + list(manifest.get("tail_tokens") or [])
