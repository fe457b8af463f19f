"""Hermes and Qwen (2.5, 3): each call a JSON object `{"name": ..., "arguments": {...}}` between
`<tool_call>` and `</tool_call>`, text before, between and after them."""

from __future__ import annotations

from engram.server.tool_parsers.base import PartialCall, Scan, ToolParser, held_back, tidy_content
from engram.server.tool_parsers.json_scan import scan_call_object, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        pieces: list[str] = []
        calls: list[PartialCall] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                pieces.append(text[pos:] if final else held_back(text[pos:], OPEN))
                break
            pieces.append(text[pos:start])
            end = self.scan_call(text, skip_ws(text, start + len(OPEN)), calls)
            if end is None:
                pieces.append("")
                break
            close = skip_ws(text, end)
            if text.startswith(CLOSE, close):
                pos = close + len(CLOSE)
            elif CLOSE.startswith(text[close:]):  # the closing tag is coming (or the reply was cut short)
                pieces.append("")
                break
            else:
                raise ValueError(f"expected {CLOSE} after a tool call")
        return Scan(tidy_content(pieces, final), calls)

    def scan_call(self, text: str, i: int, calls: list[PartialCall]) -> int | None:
        """Append the call at `i` (after the opening tag); the index after it, None if unfinished."""
        if i >= len(text):
            return None
        call = scan_call_object(text, i)
        calls.append(PartialCall(call.name, call.final_arguments if call.end is not None else call.arguments))
        return call.end
