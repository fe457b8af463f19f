"""Llama 3.1-3.3 JSON calls: the reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`. A reply that does not begin so is all content."""

from __future__ import annotations

from engram.server.tool_parsers.base import PartialCall, Scan, ToolParser
from engram.server.tool_parsers.json_scan import scan_call_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return Scan()  # nothing yet, or the tag is coming
        if i < len(text) and text[i] != "{":
            return Scan(text)
        calls: list[PartialCall] = []
        while i < len(text):
            call = scan_call_object(text, i)
            calls.append(PartialCall(call.name, call.final_arguments if call.end is not None else call.arguments))
            if call.end is None:
                break
            i = skip_ws(text, call.end)
            if i < len(text) and text[i] != ";":
                raise ValueError(f"expected ';' between calls at {text[i : i + 20]!r}")
            i = skip_ws(text, i + 1)
        return Scan("", calls)
