"""Drafters: the tokens a speculative step proposes for a sequence to verify."""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class Drafter(Protocol):
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """At most k tokens to follow `token_ids` (none: this sequence decodes one token this step)."""
        ...


class NgramDrafter:
    """Prompt lookup (vLLM's `ngram`): the last n tokens (n from `max_n` down to `min_n`) are looked
    up earlier in the sequence, prompt and output alike; the tokens after their latest earlier
    occurrence are proposed. No weights; wins where the output repeats its context (code edits,
    quoting, extraction)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        length = len(token_ids)
        if k < 1 or length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting before length - n: every earlier occurrence of the last n tokens
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start : start + k]
        return []
