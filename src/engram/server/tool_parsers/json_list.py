"""Formats whose calls are a JSON array of `{"name": ..., "arguments"|"parameters": {...}}` after a
marker: Granite 3 (`<|tool_call|>`), Mistral before v11 (`[TOOL_CALLS]`), and the reply that
`tool_choice: "required"` holds to a schema (no marker). Text before the marker is content."""

from __future__ import annotations

from engram.server.tool_parsers.base import PartialCall, Scan, ToolParser, held_back, scan_call_list, tidy_content
from engram.server.tool_parsers.json_scan import skip_ws


class JsonListToolParser(ToolParser):
    markers: tuple[str, ...] = ()  # any of them opens the list; none: the reply is the list

    def scan(self, text: str, final: bool) -> Scan:
        at, marker = self._marker(text)
        if at < 0:
            return Scan(text if final else held_back(text, *self.markers))
        calls: list[PartialCall] = []
        start = skip_ws(text, at + len(marker))
        end = self.scan_calls(text, start, calls) if start < len(text) else None
        pieces = [text[:at], "" if end is None else text[end:]]
        return Scan(tidy_content(pieces, final), calls)

    def scan_calls(self, text: str, i: int, calls: list[PartialCall]) -> int | None:
        return scan_call_list(text, i, calls)

    def _marker(self, text: str) -> tuple[int, str]:
        if not self.markers:
            return skip_ws(text, 0), ""
        found = [(text.find(m), m) for m in self.markers if m in text]
        return min(found) if found else (-1, "")


class GraniteToolParser(JsonListToolParser):
    markers = ("<|tool_call|>", "<tool_call>")
