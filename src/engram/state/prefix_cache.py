"""The prefix cache: states after whole prompts, found again by any later request whose prompt
begins with one of them (the client that resends its history every turn).

An entry is a `SequenceState` after `state_len` tokens, keyed by the prefix hash of that
position (state/chunks.py's `PrefixHasher`, the chunk store's addressing) and indexed by the hash
of the chunk boundary below it (`PrefixIndex`), so a lookup hashes the prompt's chunks once and
tests only the entries that sit in chunks the prompt shares. Host memory is the first tier, under
a byte budget, the entries that save the least compute per byte leaving first (state/eviction.py);
the store on disk (`PrefixDisk`,
state/prefix_disk.py) is the second, which survives restarts: every admitted state is also
written there, behind the request, and a lookup that finds a longer prefix on disk than in memory
loads it from there.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engram.state.chunks import PrefixHasher
from engram.state.eviction import Candidate, ComputeSavedPolicy
from engram.state.sequence_state import SequenceState
from engram.state.staging import DeviceStaging

if TYPE_CHECKING:
    from engram.state.prefix_disk import PrefixDisk


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    disk_hits: int = 0  # of `hits`: states loaded from the disk tier
    tokens_reused: int = 0
    admitted: int = 0
    evicted: int = 0


class PrefixIndex:
    """Entry keys by position, grouped by the prefix hash of the chunk boundary below each (not
    thread-safe: its owner locks)."""

    def __init__(self, hasher: PrefixHasher):
        self.hasher = hasher
        self._by_chunk: dict[bytes, dict[int, bytes]] = {}  # hash of the chunk boundary -> position -> entry key

    def place(self, tokens: Sequence[int], position: int) -> tuple[bytes, bytes]:
        """The key of the prefix `tokens[:position]` and the hash of its chunk boundary."""
        chain = self.hasher.chain(tokens, position)
        return self.hasher.at(tokens, position, chain), chain[position // self.hasher.chunk_tokens]

    def add(self, boundary: bytes, position: int, key: bytes) -> None:
        self._by_chunk.setdefault(boundary, {})[position] = key

    def remove(self, boundary: bytes, position: int) -> None:
        positions = self._by_chunk.get(boundary, {})
        positions.pop(position, None)
        if not positions:
            self._by_chunk.pop(boundary, None)

    def longest(self, tokens: Sequence[int], chain: list[bytes], usable: int) -> tuple[int, bytes] | None:
        """(position, key) of the longest entry that is a prefix of `tokens` no longer than
        `usable` (`chain`: `tokens`' chain up to `usable`)."""
        for boundary in reversed(chain):
            for position, key in sorted(self._by_chunk.get(boundary, {}).items(), reverse=True):
                if position <= usable and self.hasher.at(tokens, position, chain) == key:
                    return position, key
        return None

    def clear(self) -> None:
        self._by_chunk.clear()


class PrefixCache:
    """Thread-safe; `lookup` and `admit` hash the tokens given (O(length)); a lookup may load a
    state from the disk tier."""

    def __init__(
        self,
        hasher: PrefixHasher,
        max_bytes: int,
        min_tokens: int = 1,
        disk: PrefixDisk | None = None,
        policy: ComputeSavedPolicy = ComputeSavedPolicy(),
    ):
        self.hasher = hasher
        self.policy = policy
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens  # shorter prompts cost less to compute again than their state costs to copy out
        self.disk = disk
        self.nbytes = 0
        self.stats = PrefixCacheStats()
        self._entries: dict[bytes, tuple[SequenceState, bytes]] = {}  # key -> (state, its chunk boundary's hash)
        self._last_use: dict[bytes, int] = {}
        self._ticks = itertools.count()  # recency: only the order of uses counts
        self._index = PrefixIndex(hasher)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def wants(self, num_tokens: int) -> bool:
        """Whether a prompt this long is worth its state's capture (and a lookup: no entry is shorter)."""
        return num_tokens >= self.min_tokens

    def lookup(self, tokens: Sequence[int], staging: DeviceStaging | None = None, on_device: int = 0) -> SequenceState | None:
        """The entry covering the longest prefix of `tokens` that leaves at least one token to
        compute (the last prompt token's logits are what a request samples from), from memory or,
        if the disk tier holds a longer one, loaded from disk (verified; `staging`: copied to the
        device as it is read, for the engine's `staged`) and kept in memory.

        `on_device`: the prefix the engine holds in a slot already (the GPU tier), which it adopts
        over any state no longer than that. Then nothing is read from disk, and only a shorter
        entry in memory is returned (the slot's captures copy only the KV past it)."""
        usable = len(tokens) - 1
        if usable <= 0 or not (self._entries or self.disk is not None):
            return None
        try:
            chain = self.hasher.chain(tokens, usable)
            with self._lock:
                self.stats.lookups += 1
                found = self._index.longest(tokens, chain, usable)
            on_disk = self.disk.longest(tokens, chain, usable) if self.disk is not None else None
            if on_device and max(found[0] if found else 0, on_disk[0] if on_disk else 0) <= on_device:
                on_disk = None
                if found is not None and found[0] >= on_device:
                    with self._lock:
                        found = self._index.longest(tokens, chain, on_device - 1)
        except (OverflowError, TypeError):  # not token ids at all: the engine refuses the request with its reason
            return None
        if on_disk is not None and (found is None or on_disk[0] > found[0]):
            with self._lock:
                held = self._entries.get(found[1]) if found is not None else None
            # what memory holds of the longer prefix (its first found[0] tokens' KV) is not read again
            state = self.disk.load(on_disk[1], held[0] if held is not None else None, staging) if self.disk is not None else None
            if state is not None:
                self._admit_in_memory(state)
                with self._lock:
                    self.stats.hits += 1
                    self.stats.disk_hits += 1
                    self.stats.tokens_reused += state.state_len
                return state
        if found is None:
            return None
        with self._lock:
            entry = self._entries.get(found[1])
            if entry is None:  # evicted since
                return None
            self._last_use[found[1]] = next(self._ticks)
            self.stats.hits += 1
            self.stats.tokens_reused += found[0]
            return entry[0]

    def admit(self, state: SequenceState) -> None:
        """Keep `state` (the state after its first `state_len` tokens) in memory, pushing out the
        entries the policy values least beyond the budget, and have the disk tier write it."""
        n = state.state_len
        if n == 0 or not self.wants(n):
            return
        if self.disk is not None:
            self.disk.submit(state)
        self._admit_in_memory(state)

    def _admit_in_memory(self, state: SequenceState) -> None:
        n = state.state_len
        if state.nbytes > self.max_bytes:
            return
        key, boundary = self._index.place(state.tokens, n)
        with self._lock:
            self._drop(key)
            self._entries[key] = (state, boundary)
            self._last_use[key] = next(self._ticks)
            self._index.add(boundary, n, key)
            self.nbytes += state.nbytes
            self.stats.admitted += 1
            while self.nbytes > self.max_bytes:
                candidates = [Candidate(k, s.state_len, s.nbytes, self._last_use[k]) for k, (s, _) in self._entries.items()]
                victim = self.policy.victim(candidates, keep=key)
                if victim is None:
                    break
                self._drop(victim)
                self.stats.evicted += 1

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        state, boundary = entry
        del self._last_use[key]
        self.nbytes -= state.nbytes
        self._index.remove(boundary, state.state_len)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._last_use.clear()
            self._index.clear()
            self.nbytes = 0
