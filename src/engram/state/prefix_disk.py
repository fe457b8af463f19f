"""The prefix cache's disk tier: states after prompts (and turn ends), kept in the chunk store so
that a restarted server still finds them.

A state is stored as any turn's is (`ColdStore.save_state`: content-addressed KV pieces and a
checkpoint, writing only the files the store lacks; the longest entry it extends lends its
pieces, so a resent history writes only its new tokens' KV), then named by a small entry
(`<key>.json` through `ColdStore.put_prefix_entry`: position, chunk boundary, store references),
written after the files it names, so a crash leaves no entry naming a missing file. Writes run on
this tier's own thread, behind the request; when they fall behind, new states are skipped. A turn
end already in the store (its snapshot) costs only its entry. The entries' store files count as
referenced in the manager's sweep; an entry evicted under `max_bytes` (by the compute its bytes
save: state/eviction.py) leaves its files to it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engram.state.chunks import PrefixHasher, StoredState
from engram.state.cold import ColdStore
from engram.state.eviction import Candidate, ComputeSavedPolicy
from engram.state.prefix_cache import PrefixIndex
from engram.state.sequence_state import SequenceState
from engram.state.snapshot import SnapshotCorruptError, SnapshotError
from engram.state.staging import DeviceStaging
from engram.state.store import SnapshotWriter

ENTRY_FORMAT = "engram-prefix/1"
MAX_PENDING_WRITES = 4  # states waiting for the writer; beyond it a new one is not written (it still is kept in memory)

log = logging.getLogger(__name__)


@dataclass
class DiskEntry:
    position: int
    boundary: bytes
    stored: StoredState
    nbytes: int  # the state's bytes (KV of the prefix and recurrent tensors)
    sizes: dict[str, int]  # store key -> the bytes of that file (entries that share a prefix share its pieces)
    last_use: float

    def to_json(self, identity: str) -> dict[str, Any]:
        return {
            "format": ENTRY_FORMAT,
            "identity": identity,
            "position": self.position,
            "boundary": self.boundary.hex(),
            "store": self.stored.to_json(),
            "nbytes": self.nbytes,
            "sizes": self.sizes,
            "last_use": self.last_use,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DiskEntry:
        try:
            stored = StoredState.from_json(data["store"])
            sizes = {str(k): int(v) for k, v in data["sizes"].items()}
            entry = cls(int(data["position"]), bytes.fromhex(data["boundary"]), stored, int(data["nbytes"]), sizes, float(data["last_use"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SnapshotCorruptError(f"malformed prefix entry: {e!r}") from e
        if entry.position != stored.state_len or set(sizes) != stored.keys:
            raise SnapshotCorruptError("malformed prefix entry: its position or sizes do not match its store references")
        return entry


@dataclass
class PrefixDiskStats:
    written: int = 0  # states stored by this tier
    indexed: int = 0  # turn ends whose snapshot was already stored: an entry only
    skipped: int = 0  # states not written: the writer was behind
    loads: int = 0
    load_failures: int = 0  # damaged or missing files: the entry is dropped
    evicted: int = 0


class PrefixDisk:
    """Thread-safe. Entries are read from the store on first use, not at start-up."""

    def __init__(
        self,
        store: ColdStore,
        hasher: PrefixHasher,
        max_bytes: int,
        policy: ComputeSavedPolicy = ComputeSavedPolicy(),
        clock: Callable[[], float] = time.time,
    ):
        self.store, self.hasher, self.max_bytes = store, hasher, max_bytes
        self.policy = policy
        self.clock = clock
        self.identity = hasher.seed.hex()
        self.stats = PrefixDiskStats()
        self.nbytes = 0  # bytes of the distinct store files the entries name
        self.on_evict: Callable[[], None] = lambda: None  # files may have become unreferenced: a sweep is due
        self._index = PrefixIndex(hasher)
        self._entries: dict[bytes, DiskEntry] = {}
        self._files: dict[str, list[int]] = {}  # store key -> [entries naming it, its bytes]
        self._loaded = False
        self._pending = 0
        self._writer = SnapshotWriter()
        self._lock = threading.RLock()

    def __len__(self) -> int:
        with self._lock:
            self._ensure_loaded()
            return len(self._entries)

    # ---- lookup ------------------------------------------------------------------------------

    def longest(self, tokens: Sequence[int], chain: list[bytes], usable: int) -> tuple[int, bytes] | None:
        """(position, key) of the longest stored prefix of `tokens` no longer than `usable`."""
        with self._lock:
            self._ensure_loaded()
            return self._index.longest(tokens, chain, usable)

    def load(self, key: bytes, resident: SequenceState | None = None, staging: DeviceStaging | None = None) -> SequenceState | None:
        """The entry's state, every file verified (the pieces `resident` holds copied from it, not
        read; `staging`: copied to the device as it is read, as a conversation's cold load); None
        (and the entry dropped) if it cannot be loaded."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        try:
            state = self.store.load_state(entry.stored, resident, staging)
        except SnapshotError as e:
            log.warning("prefix cache entry %s dropped: %s", key.hex()[:12], e)
            with self._lock:
                self.stats.load_failures += 1
                self._remove(key)
            return None
        with self._lock:
            entry.last_use = self.clock()
            self.stats.loads += 1
        return state

    # ---- admission ---------------------------------------------------------------------------

    def submit(self, state: SequenceState) -> None:
        """Store `state` behind the caller (on this tier's thread), unless it is stored already or
        the writer is behind."""
        with self._lock:
            if self._touch(state):
                return
            if state.nbytes > self.max_bytes or self._pending >= MAX_PENDING_WRITES:
                self.stats.skipped += 1
                return
            self._pending += 1
        self._writer.submit(lambda: self._write(state))

    def _write(self, state: SequenceState) -> None:
        try:
            n = state.state_len
            chain = self.hasher.chain(state.tokens, n)
            with self._lock:
                found = self._index.longest(state.tokens, chain, n)
                base = self._entries[found[1]].stored if found is not None else None
            stored = self.store.save_state(state, base)
            self._add(state, stored)
            with self._lock:
                self.stats.written += 1
        finally:
            with self._lock:
                self._pending -= 1

    def index(self, state: SequenceState, stored: StoredState) -> None:
        """Name a state the store holds already (a turn's snapshot: `stored`) as an entry, behind
        the caller."""
        if stored.state_len != state.state_len or state.nbytes > self.max_bytes:
            return
        self._writer.submit(lambda: self._index_stored(state, stored))

    def _index_stored(self, state: SequenceState, stored: StoredState) -> None:
        with self._lock:
            if self._touch(state):
                return
        self._add(state, stored)
        with self._lock:
            self.stats.indexed += 1

    def _add(self, state: SequenceState, stored: StoredState) -> None:
        """Commit the entry of `state`, whose files `stored` names (all written), then evict."""
        n = state.state_len
        key, boundary = self._index.place(state.tokens, n)
        kv = sum(t.numel() * t.element_size() for piece in state.kv_pieces() for t in piece.tensors.values())
        sizes = {p.key: kv * (p.end - p.start) // n for p in stored.pieces} | {stored.checkpoint: state.nbytes - kv}
        entry = DiskEntry(n, boundary, stored, state.nbytes, sizes, self.clock())
        self.store.put_prefix_entry(key.hex(), json.dumps(entry.to_json(self.identity), sort_keys=True).encode())
        with self._lock:
            self._remove(key, drop_file=False)
            self._insert(key, entry)
            self._evict(keep=key)

    # ---- bookkeeping (under the lock) -------------------------------------------------------

    def _touch(self, state: SequenceState) -> bool:
        """Whether an entry of the state's prefix exists (then counted as a use)."""
        self._ensure_loaded()
        entry = self._entries.get(self._index.place(state.tokens, state.state_len)[0])
        if entry is not None:
            entry.last_use = self.clock()
        return entry is not None

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for name, data in self.store.prefix_entries().items():
            try:
                raw = json.loads(data)
                if raw.get("format") != ENTRY_FORMAT or raw.get("identity") != self.identity:
                    continue  # another model's, tokenizer's or layout's: not this one's to use or drop
                self._insert(bytes.fromhex(name), DiskEntry.from_json(raw))
            except (ValueError, AttributeError, SnapshotCorruptError) as e:
                log.warning("prefix cache entry %s unreadable, dropped: %s", name[:12], e)
                self.store.drop_prefix_entry(name)
        self._evict(keep=None)  # the budget may be smaller than the last run's

    def _insert(self, key: bytes, entry: DiskEntry) -> None:
        self._entries[key] = entry
        self._index.add(entry.boundary, entry.position, key)
        for k, size in entry.sizes.items():
            held = self._files.setdefault(k, [0, size])
            if held[0] == 0:
                self.nbytes += size
            held[0] += 1

    def _remove(self, key: bytes, drop_file: bool = True) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._index.remove(entry.boundary, entry.position)
        for k in entry.sizes:
            held = self._files[k]
            held[0] -= 1
            if held[0] == 0:
                self.nbytes -= held[1]
                del self._files[k]
        if drop_file:
            self.store.drop_prefix_entry(key.hex())

    def _evict(self, keep: bytes | None) -> None:
        evicted = False
        while self.nbytes > self.max_bytes:
            victim = self.policy.victim([Candidate(k, e.position, e.nbytes, e.last_use) for k, e in self._entries.items()], keep)
            if victim is None:
                break
            self._remove(victim)
            self.stats.evicted += 1
            evicted = True
        if evicted:
            self.on_evict()

    # ---- the manager's -----------------------------------------------------------------------

    def referenced(self) -> set[str]:
        """The store keys every entry names (a sweep keeps them)."""
        with self._lock:
            self._ensure_loaded()
            return {k for entry in self._entries.values() for k in entry.sizes}

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.nbytes, **asdict(self.stats)}

    def flush(self) -> None:
        """Wait for the writes submitted so far."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
