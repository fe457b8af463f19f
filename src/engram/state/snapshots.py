"""The turns' snapshots in the COLD tier, through `ColdStore` (state/cold.py): where each turn's
is, what store files it names, writing one over its chain's nearest stored turn, and loading one
verified against the conversation's record.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from engram.state.chunks import StoredState
from engram.state.cold import ColdStore
from engram.state.manifest import stored_state
from engram.state.sequence_state import SequenceState
from engram.state.snapshot import SnapshotCorruptError, SnapshotError, SnapshotMeta, SnapshotNotFoundError, snapshot_label
from engram.state.staging import DeviceStaging
from engram.state.store import TierStats
from engram.state.turns import Conversation, Turn, ref_name

log = logging.getLogger(__name__)


class TurnSnapshots:
    """Each turn's snapshot in `store`, and the store references each names (kept from its save or
    first read, so that the next save and a sweep need not read its manifest again). `lock` (the
    conversation manager's) guards those and `stats`; the files are read and written outside it."""

    def __init__(self, store: ColdStore, stats: TierStats, lock: threading.RLock):
        self.store = store
        self.stats = stats
        self._lock = lock
        self._stored: dict[tuple[str, str], StoredState] = {}  # (conversation, ref) -> its snapshot's store references

    def locate(self, conversation_id: str, turn: Turn) -> str:
        return self.store.locate(conversation_id, turn.branch, turn.turn)

    def stored_of(self, conversation_id: str, turn: Turn) -> StoredState | None:
        """The store references of a turn's snapshot (None for a v1 file), from memory or its manifest."""
        stored = self._stored.get((conversation_id, turn.ref))
        if stored is None:
            stored = self.store.references(self.locate(conversation_id, turn))
        return stored

    def stored_base(self, conv: Conversation, turn: Turn) -> StoredState | None:
        """The store references of the nearest earlier turn in `turn`'s chain that has a v2
        snapshot: its pieces are the new snapshot's too, so only what follows them is written.
        Called under the lock."""
        for t in reversed(conv.chain(turn)[:-1]):
            if not t.snapshot:
                continue
            try:
                return self.stored_of(conv.conversation_id, t)
            except SnapshotError as e:
                log.warning("conversation %r turn %s: %s; its snapshot lends nothing to the next", conv.conversation_id, t.ref, e)
                return None
        return None

    def save(self, conv: Conversation, turn: Turn, state: SequenceState, base: StoredState | None) -> StoredState:
        """Write the turn's snapshot (counted and timed): the store files its base lacks, then its
        manifest; no record points at it yet."""
        meta = SnapshotMeta(conversation_id=conv.conversation_id, branch=turn.branch, turn=turn.turn, parent=turn.parent)
        started = time.perf_counter()
        try:
            stored = self.store.save(state, meta, base)
        except Exception:
            with self._lock:
                self.stats.snapshot_write_failures += 1
            raise
        with self._lock:
            self._stored[(conv.conversation_id, turn.ref)] = stored
            self.stats.snapshot_write_seconds.observe(time.perf_counter() - started)
        return stored

    def load(self, conv: Conversation, turn: Turn, resident: SequenceState | None, staging: DeviceStaging | None = None) -> SequenceState:
        """Load and verify the turn's snapshot, which must be this turn's and hold its recorded
        history's tokens; the KV that `resident` holds is taken from it, not read; `staging`
        copies it to a device as it is read (its `state` is the engine's only if this returns)."""
        path = self.locate(conv.conversation_id, turn)
        state, manifest = self.store.load(path, resident, staging)
        self._check_belongs(manifest, path, conv, turn)
        stored = stored_state(manifest, snapshot_label(path))
        if stored is not None:
            with self._lock:
                self._stored[(conv.conversation_id, turn.ref)] = stored
        if list(state.tokens[: state.state_len]) != conv.tokens(turn)[: state.state_len]:
            raise SnapshotCorruptError(f"{snapshot_label(path)}: its tokens are not the recorded history of turn {turn.ref}")
        return state

    def manifest(self, conv: Conversation, turn: Turn) -> dict[str, Any]:
        """The turn's snapshot manifest, with its "path"."""
        path = self.locate(conv.conversation_id, turn)
        if not turn.snapshot or not self.store.exists(path):
            raise SnapshotNotFoundError(f"turn {turn.ref} of conversation {conv.conversation_id!r} has no snapshot")
        manifest = self.store.manifest(path)
        self._check_belongs(manifest, path, conv, turn)
        return {**manifest, "path": path}

    @staticmethod
    def _check_belongs(manifest: dict[str, Any], path: str, conv: Conversation, turn: Turn) -> None:
        """Raise SnapshotCorruptError unless the file's manifest names this conversation's turn
        and the state length its record holds (the checksum covers the tensors, not the manifest)."""
        named = (manifest.get("conversation_id"), manifest.get("branch"), manifest.get("turn"), manifest.get("state_len"))
        recorded = (conv.conversation_id, turn.branch, turn.turn, turn.state_len)
        if named != recorded:
            raise SnapshotCorruptError(
                f"{snapshot_label(path)}: the manifest names (conversation, branch, turn, state_len) {named!r}, the record {recorded!r}"
            )

    def forget(self, conversation_id: str, ref: str) -> None:
        self._stored.pop((conversation_id, ref), None)

    def delete(self, conversation_id: str, branch: str, turn: int) -> None:
        """Delete a turn's snapshot (SnapshotNotFoundError if it has none): its manifest; the store
        files it shares with other turns stay until a sweep finds nothing referencing them."""
        self.forget(conversation_id, ref_name(branch, turn))
        self.store.delete(self.store.locate(conversation_id, branch, turn))

    def unrecorded(self, conv: Conversation) -> list[str]:
        """The snapshots stored for the conversation that its record does not list."""
        recorded = {self.locate(conv.conversation_id, t) for t in conv.turns.values() if t.snapshot}
        return [entry["path"] for entry in self.store.snapshots(conv.conversation_id) if entry["path"] not in recorded]
