"""The prefix cache in host memory: states after whole prompts, found again by any later request
whose prompt begins with one of them (the client that resends its history every turn).

An entry is a `SequenceState` after `state_len` tokens, keyed by the prefix hash of that
position (state/chunks.py's `PrefixHasher`, the chunk store's addressing) and indexed by the hash
of the chunk boundary below it, so a lookup hashes the prompt's chunks once and tests only the
entries that sit in chunks the prompt shares. Least recently used entries leave first, under a
byte budget.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engram.state.chunks import PrefixHasher
from engram.state.sequence_state import SequenceState


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    admitted: int = 0
    evicted: int = 0


class PrefixCache:
    """Thread-safe; `lookup` and `admit` hash the tokens given (O(length)), nothing more."""

    def __init__(self, hasher: PrefixHasher, max_bytes: int, min_tokens: int = 1):
        self.hasher = hasher
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens  # shorter prompts cost less to compute again than their state costs to copy out
        self.nbytes = 0
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[bytes, tuple[SequenceState, bytes]] = OrderedDict()  # key -> (state, its chunk boundary's hash)
        self._by_chunk: dict[bytes, dict[int, bytes]] = {}  # hash of the chunk boundary -> position -> entry key
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def wants(self, num_tokens: int) -> bool:
        """Whether a prompt this long is worth its state's capture (and a lookup: no entry is shorter)."""
        return num_tokens >= self.min_tokens

    def lookup(self, tokens: Sequence[int]) -> SequenceState | None:
        """The entry covering the longest prefix of `tokens` that leaves at least one token to
        compute (the last prompt token's logits are what a request samples from)."""
        usable = len(tokens) - 1
        if usable <= 0 or not self._entries:
            return None
        try:
            chain = self.hasher.chain(tokens, usable)
            with self._lock:
                self.stats.lookups += 1
                for boundary in reversed(chain):
                    for position, key in sorted(self._by_chunk.get(boundary, {}).items(), reverse=True):
                        if position <= usable and self.hasher.at(tokens, position, chain) == key:
                            self._entries.move_to_end(key)
                            self.stats.hits += 1
                            self.stats.tokens_reused += position
                            return self._entries[key][0]
        except (OverflowError, TypeError):  # not token ids at all: the engine refuses the request with its reason
            return None
        return None

    def admit(self, state: SequenceState) -> None:
        """Keep `state` (the state after its first `state_len` tokens), pushing out the least
        recently used entries beyond the budget."""
        n = state.state_len
        if n == 0 or not self.wants(n) or state.nbytes > self.max_bytes:
            return
        chain = self.hasher.chain(state.tokens, n)
        key, boundary = self.hasher.at(state.tokens, n, chain), chain[n // self.hasher.chunk_tokens]
        with self._lock:
            self._drop(key)
            self._entries[key] = (state, boundary)
            self._by_chunk.setdefault(boundary, {})[n] = key
            self.nbytes += state.nbytes
            self.stats.admitted += 1
            while self.nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.stats.evicted += 1

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        state, boundary = entry
        self.nbytes -= state.nbytes
        positions = self._by_chunk.get(boundary, {})
        positions.pop(state.state_len, None)
        if not positions:
            self._by_chunk.pop(boundary, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_chunk.clear()
            self.nbytes = 0
