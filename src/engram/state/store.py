"""The WARM tier (host-memory states under count and byte budgets), the snapshot writer that
keeps disk I/O off the request path, and the per-tier counters.

Tiers: ACTIVE (the state still sits in an engine slot), WARM (a host copy, pinned when the engine
runs on CUDA), COLD (a snapshot file). Promotion happens on access, demotion by idle time and by
pressure; each move keeps the turn's metadata and token history, which live in the conversation
record, not in the state.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engram.state.sequence_state import SequenceState

log = logging.getLogger(__name__)

Clock = Callable[[], float]
TIERS = ("active", "warm", "cold")
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics) with count and sum."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[index] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def summary(self) -> dict[str, Any]:
        return {"count": self.count, "sum": self.total, "mean": self.total / self.count if self.count else None}


@dataclass
class TierStats:
    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    misses: int = 0  # continuations that found no state and prefilled the whole history
    promotions: dict[str, int] = field(default_factory=lambda: {"cold_to_warm": 0})
    demotions: dict[str, int] = field(default_factory=lambda: {"active_to_warm": 0, "warm_to_cold": 0, "warm_evicted": 0})
    expired_conversations: int = 0
    restore_seconds: dict[str, Histogram] = field(default_factory=lambda: {t: Histogram() for t in TIERS})
    snapshot_write_seconds: Histogram = field(default_factory=Histogram)
    snapshot_write_failures: int = 0


class WarmCache:
    """Host-memory states of recent turns, least recently used first out.

    Bounded by the conversations it holds states of (`--max-warm-conversations`; a conversation may
    hold several turns' states) and by bytes; `on_evict` gets each state pushed out by pressure.
    `nbytes` counts the host memory the states keep alive: a KV segment that several turns' states
    share (a capture reuses its base's) is counted once, in full, while any of them is here."""

    def __init__(self, max_conversations: int, max_bytes: int, clock: Clock = time.time):
        self.max_conversations = max_conversations
        self.max_bytes = max_bytes
        self.clock = clock
        self.nbytes = 0
        self._blocks: dict[int, list[int]] = {}  # memory block address -> [size, states holding it]
        self._states: OrderedDict[tuple[str, str], tuple[SequenceState, float]] = OrderedDict()
        self.on_evict: Callable[[str, str, SequenceState], None] = lambda conversation_id, ref, state: None

    def __len__(self) -> int:
        return len(self._states)

    def get(self, conversation_id: str, ref: str) -> SequenceState | None:
        entry = self._states.get((conversation_id, ref))
        if entry is None:
            return None
        self._states[(conversation_id, ref)] = (entry[0], self.clock())
        self._states.move_to_end((conversation_id, ref))
        return entry[0]

    def peek(self, conversation_id: str, ref: str) -> SequenceState | None:
        """The state without counting it as a use."""
        entry = self._states.get((conversation_id, ref))
        return entry[0] if entry is not None else None

    def states(self) -> list[tuple[str, str, SequenceState]]:
        """Every state here as (conversation, ref, state), without counting a use."""
        return [(cid, ref, state) for (cid, ref), (state, _) in self._states.items()]

    def fits(self, state: SequenceState) -> bool:
        """Whether the state could stay here alone: the memory blocks it keeps alive are within the budget."""
        return self.max_conversations > 0 and sum(state.storages().values()) <= self.max_bytes

    def put(self, conversation_id: str, ref: str, state: SequenceState) -> None:
        """Keep the state, pushing out the least recently used beyond the budgets; one that does not
        `fit` is not kept (and pushes nothing out)."""
        self.drop(conversation_id, ref)
        if not self.fits(state):
            return
        self._states[(conversation_id, ref)] = (state, self.clock())
        for address, size in state.storages().items():
            held = self._blocks.setdefault(address, [size, 0])
            self.nbytes += size if held[1] == 0 else 0
            held[1] += 1
        while self._states:
            latest = self._latest_use()
            if len(latest) > self.max_conversations:  # every state of the least recently used conversation
                out = min(latest, key=latest.__getitem__)
                victims = [key for key in self._states if key[0] == out]
            elif self.nbytes > self.max_bytes:  # the least recently used state
                victims = [next(iter(self._states))]
            else:
                break
            for cid, old_ref in victims:  # never the new state: it fits alone, and it is the latest use
                if (cid, old_ref) not in self._states:  # dropped by on_evict of an earlier victim
                    continue
                old_state = self._states[(cid, old_ref)][0]
                self.drop(cid, old_ref)
                self.on_evict(cid, old_ref, old_state)

    def _latest_use(self) -> dict[str, int]:
        """Each conversation's most recently used state, as a place in the use order."""
        return {conversation_id: place for place, (conversation_id, _) in enumerate(self._states)}

    def drop(self, conversation_id: str, ref: str | None = None) -> None:
        for key in [k for k in self._states if k[0] == conversation_id and (ref is None or k[1] == ref)]:
            for address in self._states.pop(key)[0].storages():
                held = self._blocks[address]
                held[1] -= 1
                if held[1] == 0:
                    self.nbytes -= self._blocks.pop(address)[0]

    def idle(self, older_than: float) -> list[tuple[str, str]]:
        """Keys not used since `older_than` (a clock reading)."""
        return [key for key, (_, used) in self._states.items() if used < older_than]


class SnapshotWriter:
    """One background thread that runs snapshot writes in order (`async` durability).

    With `sync` durability the caller runs the write itself and this class is not used. A crash
    loses only writes still queued; every file it did write is complete (atomic commit)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engram-snapshot-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], object]) -> None:
        self._jobs.put(job)

    def flush(self) -> None:
        """Wait until every job submitted so far has run."""
        done = threading.Event()
        self._jobs.put(done.set)
        done.wait()

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:
                log.exception("background snapshot write failed")
