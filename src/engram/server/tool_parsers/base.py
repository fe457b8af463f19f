"""What every tool call parser returns, and the pieces they share.

A parser reads the reply's text so far and says what it holds: the text outside the calls
(`Scan.content`) and each call's name and arguments as far as they have come. Read again with
more text, each of these only grows: a stream sends what grew (server/tool_parsers/stream.py),
and the whole reply read once gives what those deltas add up to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engram.server.tool_parsers.json_scan import scan_call_object, skip_ws


@dataclass
class PartialCall:
    name: str | None  # None until the whole name has been read
    arguments: str = ""  # JSON text so far


@dataclass
class Scan:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser:
    """A model family's tool call format. `tools`: the request's tool definitions (OpenAI's
    `{"type": "function", "function": {...}}`), for formats whose values need the parameter types."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def scan(self, text: str, final: bool) -> Scan:
        """Raises ValueError when the text is not in the format (it is then all content)."""
        raise NotImplementedError

    def call_id(self, prefix: str, index: int) -> str:
        """The id of the reply's call `index`, from the reply's `prefix` ("call_<hex>")."""
        return f"{prefix}_{index}"


def held_back(text: str, *markers: str) -> str:
    """`text` without an ending that may be the start of one of `markers` (a stream waits for it)."""
    cut = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-k:]):
                cut = max(cut, k)
                break
    return text[: len(text) - cut]


def tidy_content(pieces: list[str], final: bool) -> str:
    """The text around the calls: `pieces[i]` comes before call i, the last one after the last
    call. Whitespace next to a call is dropped; so is the trailing whitespace of an unfinished
    reply (a call may follow it)."""
    out = []
    for i, piece in enumerate(pieces):
        if i > 0:
            piece = piece.lstrip()
        if i < len(pieces) - 1 or not final:
            piece = piece.rstrip()
        out.append(piece)
    return "".join(out)


def scan_call_list(text: str, i: int, calls: list[PartialCall]) -> int | None:
    """The calls of a JSON array of call objects whose `[` is at `i`, appended to `calls`; the
    index after the array, None if it has not ended yet."""
    if text[i] != "[":
        raise ValueError(f"expected a JSON array of tool calls at {text[i : i + 20]!r}")
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "]":
            return j + 1
        call = scan_call_object(text, j)
        calls.append(PartialCall(call.name, call.final_arguments if call.end is not None else call.arguments))
        if call.end is None:
            return None
        j = skip_ws(text, call.end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
        elif j < len(text) and text[j] != "]":
            raise ValueError(f"expected ',' or ']' at {text[j : j + 20]!r}")
    return None
