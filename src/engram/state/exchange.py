"""One conversation as one file, both ways (the file's format: state/transfer.py): what an export
holds of a conversation and its snapshots, and what an import reads back. Reserving the imported
conversation and committing it is the conversation manager's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any, cast

from engram.state.manifest import stored_state
from engram.state.snapshot import SnapshotCorruptError, snapshot_label, validate_id
from engram.state.snapshots import TurnSnapshots
from engram.state.transfer import Export, read_export
from engram.state.turns import Conversation, ref_name


def export_of(conv: Conversation, saved: TurnSnapshots) -> Export:
    """The conversation's record, every snapshot it lists and the store files they name (a
    snapshot deleted meanwhile is left out). Called under the manager's lock."""
    export = Export(record=conv.to_json())
    for t in (t for t in conv.turns.values() if t.snapshot):
        location = saved.locate(conv.conversation_id, t)
        try:
            data = saved.store.read(location)
        except FileNotFoundError:
            continue
        suffix = Path(location).suffix
        export.turns[f"turns/{t.branch}/{t.turn:06d}{suffix}"] = data
        stored = stored_state(json.loads(data), snapshot_label(location)) if suffix == ".json" else None
        if stored is not None:
            export.store_files.update(saved.store.store_members(stored))
    return export


def read_import(
    src: IO[bytes], saved: TurnSnapshots, tenant: str | None, conversation_id: str | None
) -> tuple[Conversation, dict[str, tuple[str, bytes]]]:
    """The conversation an export holds, as `conversation_id` (default: its own id), belonging
    to `tenant`, and its turns' snapshot files by ref (suffix, bytes); the store files are adopted
    into the store as they come (unreferenced until a snapshot naming them is written)."""
    record: dict[str, Any] | None = None
    snapshots: dict[str, tuple[str, bytes]] = {}
    for kind, item in read_export(src):
        if kind == "index":
            record = cast(dict[str, Any], item)
        elif kind == "turn":
            branch, number, suffix, data = cast(tuple[str, int, str, bytes], item)
            snapshots[ref_name(validate_id(branch, "branch"), number)] = (suffix, data)
        else:
            saved.store.adopt(*cast(tuple[str, str, IO[bytes]], item))
    try:
        if record is None:
            raise KeyError("the export holds no record")
        conv = Conversation.from_json(record)
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise SnapshotCorruptError(f"the export's conversation record is unreadable: {e!r}") from e
    cid = validate_id(conversation_id or conv.conversation_id, "conversation_id")
    renamed = cid != conv.conversation_id
    conv.conversation_id, conv.owner = cid, tenant
    for t in conv.turns.values():
        validate_id(t.branch, "branch")
        t.snapshot = t.ref in snapshots and not (renamed and snapshots[t.ref][0] == "safetensors")  # v1 names its conversation inside
    return conv, snapshots


def write_imported(saved: TurnSnapshots, conv: Conversation, ref: str, suffix: str, data: bytes) -> str:
    """Write one imported turn's snapshot file, its manifest naming the conversation it now belongs to; where it went."""
    turn = conv.turns[ref]
    if suffix == "json":
        manifest = json.loads(data)
        manifest["conversation_id"] = conv.conversation_id
        data = json.dumps(manifest, sort_keys=True).encode()
    location = saved.store.locate(conv.conversation_id, turn.branch, turn.turn, suffix)
    saved.store.write(location, data)
    return location
