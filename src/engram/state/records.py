"""The conversation records on disk: `<root>/<conversation>/conversation.json`, one per
conversation (its turns, state/turns.py), beside the folders of its snapshots.

Reading, listing and removing them; writing one is the conversation manager's, which orders it
after the snapshot files it lists (docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engram.state.snapshot import (
    RECORD_NAME,
    check_no_links,
    check_no_links_under,
    is_stale_temp_file,
    read_no_follow,
    reason_without_paths,
    validate_id,
)
from engram.state.turns import Conversation, ConversationRecordError

log = logging.getLogger(__name__)


class RecordFiles:
    """The records under `root`; no link under it is followed."""

    def __init__(self, root: Path):
        self.root = root

    def path(self, conversation_id: str) -> Path:
        return check_no_links(self.root, self.root / validate_id(conversation_id, "conversation_id") / RECORD_NAME)

    def exists(self, conversation_id: str) -> bool:
        return self.path(conversation_id).is_file()

    def check_folder(self, conversation_id: str) -> None:
        """Refuse (SnapshotLinkError) a conversation folder that holds a link, before a file of it is read or removed."""
        check_no_links_under(self.root, self.root / validate_id(conversation_id, "conversation_id"))

    def read(self, conversation_id: str) -> Conversation:
        try:
            conv = Conversation.from_json(json.loads(read_no_follow(self.path(conversation_id))))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConversationRecordError(f"the record of conversation {conversation_id!r} is unreadable: {reason_without_paths(e)}") from e
        if conv.conversation_id != conversation_id:
            raise ConversationRecordError(f"the record of conversation {conversation_id!r} is that of {conv.conversation_id!r}")
        return conv

    @staticmethod
    def encode(conv: Conversation) -> bytes:
        return json.dumps(conv.to_json()).encode()

    def ids(self) -> set[str]:
        """The conversations that have a record (a linked one is left out)."""
        if not self.root.is_dir():
            return set()
        return {p.parent.name for p in self.root.glob(f"*/{RECORD_NAME}") if not (p.is_symlink() or p.parent.is_symlink())}

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

    def remove(self, conversation_id: str, with_branch_files: bool) -> None:
        """Delete the record and the conversation's folders once empty; `with_branch_files`: every
        file of its branch folders first (when no readable record says which are its snapshots)."""
        record = self.path(conversation_id)
        folder = record.parent
        if with_branch_files:
            for path in folder.glob("*/*"):
                if path.is_file():
                    path.unlink()
        record.unlink(missing_ok=True)
        for branch in sorted(folder.glob("*"), reverse=True):
            if branch.is_dir() and not any(branch.iterdir()):
                branch.rmdir()
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
