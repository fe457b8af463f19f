"""The conversation records in a folder: `<root>/<conversation>/conversation.json`, one per
conversation (its turns, state/turns.py), beside the folders of its snapshots.

`RecordFiles` is the filesystem side of the ColdStore's record methods (state/cold.py), and what
only a folder has: write times (last use, preload order), the temp files a crash leaves, a
conversation's folders. With an object store the folder is its cache, which holds a copy of each
record read or written (state/object_store.py). Writing one is ordered by the conversation
manager after the snapshot files it lists (docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engram.state.snapshot import (
    RECORD_NAME,
    atomic_write,
    check_no_links,
    check_no_links_under,
    is_stale_temp_file,
    read_no_follow,
    reason_without_paths,
    validate_id,
)
from engram.state.turns import Conversation, ConversationRecordError

log = logging.getLogger(__name__)


def decode_record(conversation_id: str, data: bytes) -> Conversation:
    """The conversation a record holds; ConversationRecordError if it is unreadable or another's."""
    try:
        conv = Conversation.from_json(json.loads(data))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ConversationRecordError(f"the record of conversation {conversation_id!r} is unreadable: {reason_without_paths(e)}") from e
    if conv.conversation_id != conversation_id:
        raise ConversationRecordError(f"the record of conversation {conversation_id!r} is that of {conv.conversation_id!r}")
    return conv


def encode_record(conv: Conversation) -> bytes:
    return json.dumps(conv.to_json()).encode()


class RecordFiles:
    """The records under `root`; no link under it is followed."""

    def __init__(self, root: Path):
        self.root = root

    def path(self, conversation_id: str) -> Path:
        return check_no_links(self.root, self.root / validate_id(conversation_id, "conversation_id") / RECORD_NAME)

    def check_folder(self, conversation_id: str) -> None:
        """Refuse (SnapshotLinkError) a conversation folder that holds a link, before a file of it is read or removed."""
        check_no_links_under(self.root, self.root / validate_id(conversation_id, "conversation_id"))

    def read(self, conversation_id: str) -> bytes | None:
        """The record (None: it has none)."""
        path = self.path(conversation_id)
        if not path.is_file():
            return None
        self.check_folder(conversation_id)
        try:
            return bytes(read_no_follow(path))
        except OSError as e:
            raise ConversationRecordError(f"the record of conversation {conversation_id!r} is unreadable: {reason_without_paths(e)}") from e

    def write(self, conversation_id: str, data: bytes) -> None:
        atomic_write(self.path(conversation_id), data)

    def delete(self, conversation_id: str) -> None:
        self.path(conversation_id).unlink(missing_ok=True)

    def ids(self) -> list[str]:
        """The conversations that have a record, in order (a linked one is left out)."""
        if not self.root.is_dir():
            return []
        return sorted(p.parent.name for p in self.root.glob(f"*/{RECORD_NAME}") if not (p.is_symlink() or p.parent.is_symlink()))

    def modified(self, conversation_id: str) -> float | None:
        """When the record was last written (None: it has none)."""
        path = self.path(conversation_id)
        return path.stat().st_mtime if path.is_file() else None

    def most_recent(self, count: int) -> list[str]:
        """The `count` conversations whose records were written last, latest first."""
        if not self.root.is_dir():
            return []
        records = sorted(self.root.glob(f"*/{RECORD_NAME}"), key=lambda p: p.stat().st_mtime, reverse=True)
        return [p.parent.name for p in records[:count]]

    def remove_stale_temp_files(self, conversation_id: str) -> None:
        """Delete the temp files of writes under the conversation's folder that a crash cut short."""
        for path in self.path(conversation_id).parent.rglob(".*.tmp-*"):
            if is_stale_temp_file(path):
                log.warning("removing %s: the temp file of a write that never finished", path)
                path.unlink(missing_ok=True)

    def remove_branch_files(self, conversation_id: str) -> None:
        """Delete every file of the conversation's branch folders (when no readable record says
        which are its snapshots)."""
        for path in self.path(conversation_id).parent.glob("*/*"):
            if path.is_file():
                path.unlink()

    def remove_empty_folders(self, conversation_id: str) -> None:
        """Remove the conversation's branch folders and its own, those that are empty."""
        folder = self.path(conversation_id).parent
        for branch in sorted(folder.glob("*"), reverse=True):
            if branch.is_dir() and not any(branch.iterdir()):
                branch.rmdir()
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
