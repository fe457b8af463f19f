"""Text to token ids for requests: text that is not valid Unicode is the client's error."""

from __future__ import annotations

from typing import Any

from engram.server.errors import APIError


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    try:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return ids
    except (TypeError, UnicodeError):  # a lone surrogate ("\ud800") reaches the tokenizer as a TypeError
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"the text is not valid Unicode: {e.reason} at character {e.start}") from None
        raise
