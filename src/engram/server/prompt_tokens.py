"""Token ids of chat prompts that extend a recent one (a client that resends its whole history
every turn): only the text after the last added token they share is encoded again.

Exact by the tokenizer's own pipeline: it splits its input at added tokens (`<|end|>`, `<|im_start|>`
...) before normalizing and modelling the pieces between them, each on its own, so encode(A + B) ==
encode(A) + encode(B) whenever A ends with an added token. Tokenizers for which a piece still
depends on what precedes it (a SentencePiece prefix space on the first piece only, an added token
that strips the whitespace after it) fail a check over random texts at start-up, and encode every
prompt whole.
"""

from __future__ import annotations

import random
import threading
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

from engram.server.tokens import encode

_ALPHABET = "abcXYZ019 \n\t.,:;!?'\"-_<>|/é中🙂"


@dataclass(frozen=True)
class _Encoded:
    text: str
    ids: array[int]  # of the whole text
    cut: int  # characters up to the end of the text's last added token
    kept: int  # ids of text[:cut]


def added_token_texts(tokenizer: Any) -> list[str]:
    return sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.content})


def splits_at_added_tokens(tokenizer: Any, markers: list[str], trials: int = 300) -> bool:
    """Whether encode(A + B) == encode(A) + encode(B) for random texts A ending with an added token
    and B (empty, or beginning with whitespace, letters or another added token)."""
    rng = random.Random(0)

    def text(n: int) -> str:
        return "".join(rng.choice(_ALPHABET) if rng.random() > 0.1 else rng.choice(markers) for _ in range(n))

    for i in range(trials):
        a = text(rng.randrange(12)) + rng.choice(markers)
        b = rng.choice(["", " ", "\n", "  x", "\n\n", rng.choice(markers)]) * (i % 7 != 0) + text(rng.randrange(12))
        if encode(tokenizer, a + b, add_special_tokens=False) != encode(tokenizer, a, add_special_tokens=False) + encode(
            tokenizer, b, add_special_tokens=False
        ):
            return False
    return True


class PromptEncoder:
    """Thread-safe. Remembers the last `capacity` prompts of at least `min_chars` characters."""

    def __init__(self, tokenizer: Any, capacity: int = 16, min_chars: int = 4096):
        self.tokenizer = tokenizer
        self.min_chars = min_chars
        self.markers = added_token_texts(tokenizer) if tokenizer is not None else []
        self.enabled = bool(self.markers) and splits_at_added_tokens(tokenizer, self.markers)
        self.reused_chars = 0  # characters not encoded again
        self._recent: deque[_Encoded] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """`text`'s ids (no special tokens added: a rendered chat template has its own)."""
        if not self.enabled or len(text) < self.min_chars:
            return encode(self.tokenizer, text, add_special_tokens=False)
        base = self._longest_prefix(text)
        if base is None:
            ids = encode(self.tokenizer, text, add_special_tokens=False)
        else:
            ids = base.ids[: base.kept].tolist() + encode(self.tokenizer, text[base.cut :], add_special_tokens=False)
            with self._lock:
                self.reused_chars += base.cut
        self._remember(text, ids)
        return ids

    def _longest_prefix(self, text: str) -> _Encoded | None:
        with self._lock:
            found = [e for e in self._recent if len(e.text) <= len(text) and text.startswith(e.text)]
        return max(found, key=lambda e: e.cut, default=None)

    def _remember(self, text: str, ids: list[int]) -> None:
        cut = max((at + len(m) for m in self.markers if (at := text.rfind(m)) >= 0), default=0)
        if cut < len(text) // 2:  # most of it after the last added token: no saving next time
            return
        tail = encode(self.tokenizer, text[cut:], add_special_tokens=False) if cut < len(text) else []
        entry = _Encoded(text, array("q", ids), cut, len(ids) - len(tail))
        with self._lock:
            self._recent.append(entry)
