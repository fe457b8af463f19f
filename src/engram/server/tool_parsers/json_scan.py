"""Reading JSON that is still arriving: where a value ends (None while it has not yet), and the
fields of a tool call object as far as the text holds them.

A call's arguments are passed on as the model wrote them (the raw text of the value), so that the
fragments a stream sends while the value grows concatenate to the arguments of the whole reply.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\n\r"
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|true|false|null")
ARGUMENT_KEYS = ("arguments", "parameters")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value that starts at `i`; None if the text ends before it does.
    Raises ValueError on a character no JSON value starts with. Brackets are only counted:
    `json.loads` of the finished value is what checks it."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = _SCALAR.match(text, i)
    if m is None:
        if any(word.startswith(text[i:]) for word in ("true", "false", "null")) or text[i:] == "-":
            return None
        raise ValueError(f"not a JSON value at {text[i : i + 20]!r}")
    return m.end() if m.end() < len(text) else None  # "12" may go on as "123"


@dataclass
class CallObject:
    """`{"name": ..., "arguments": {...}}` as far as the text goes."""

    name: str | None = None  # once its string is whole
    arguments: str = ""  # the value's raw text so far (an object or array); a JSON string's content once whole
    end: int | None = None  # the index after the closing brace
    has_arguments: bool = False

    @property
    def final_arguments(self) -> str:
        return self.arguments if self.has_arguments else "{}"


def scan_call_object(text: str, i: int, keys: tuple[str, ...] = ARGUMENT_KEYS) -> CallObject:
    """The call object whose `{` is at `i`. Raises ValueError when it is not a call object."""
    if text[i] != "{":
        raise ValueError(f"expected a JSON object at {text[i : i + 20]!r}")
    call = CallObject()
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            call.end = j + 1
            break
        if text[j] != '"':
            raise ValueError(f"expected a key at {text[j : j + 20]!r}")
        key_end = _string_end(text, j)
        if key_end is None:
            return call
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return call
        if text[j] != ":":
            raise ValueError(f"expected ':' after the key {key!r}")
        v = skip_ws(text, j + 1)
        if v >= len(text):
            return call
        end = value_end(text, v)
        if key == "name" and end is not None:
            call.name = json.loads(text[v:end])
            if not isinstance(call.name, str):
                raise ValueError("a tool call's name is not a string")
        elif key in keys:
            call.has_arguments = True
            if end is not None and text[v] == '"':
                call.arguments = json.loads(text[v:end])  # arguments sent as a JSON string
            elif end is not None or text[v] in "{[":
                call.arguments = text[v:end]
        if end is None:
            return call
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
        elif j < len(text) and text[j] != "}":
            raise ValueError(f"expected ',' or '}}' at {text[j : j + 20]!r}")
    if call.end is not None:
        json.loads(text[i : call.end])  # the whole object must be JSON
        if call.name is None:
            raise ValueError("a tool call object without a name")
    return call
