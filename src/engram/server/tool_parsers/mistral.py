"""Mistral: `[TOOL_CALLS]` then a JSON array of calls (tokenizers before v11), or then
`NAME[ARGS]{...}` once per call (v11 and later), text before the marker as content."""

from __future__ import annotations

import hashlib

from engram.server.tool_parsers.base import PartialCall, scan_call_list
from engram.server.tool_parsers.json_list import JsonListToolParser
from engram.server.tool_parsers.json_scan import skip_ws, value_end

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(JsonListToolParser):
    markers = (TOOL_CALLS,)

    def call_id(self, prefix: str, index: int) -> str:
        """Nine letters and digits: Mistral's chat templates refuse any other id of a call sent back."""
        return hashlib.sha256(f"{prefix}_{index}".encode()).hexdigest()[:9]

    def scan_calls(self, text: str, i: int, calls: list[PartialCall]) -> int | None:
        if text[i] == "[":
            return scan_call_list(text, i, calls)
        while True:  # NAME[ARGS]{...}, each call after its own [TOOL_CALLS] but the first
            args = text.find(ARGS, i)
            if args < 0:
                return None
            call = PartialCall(text[i:args].strip())
            calls.append(call)
            v = skip_ws(text, args + len(ARGS))
            if v >= len(text):
                return None
            end = value_end(text, v)
            call.arguments = text[v:end]
            if end is None:
                return None
            nxt = skip_ws(text, end)
            if not text.startswith(TOOL_CALLS, nxt):
                return end if len(text) - nxt >= len(TOOL_CALLS) or not TOOL_CALLS.startswith(text[nxt:]) else None
            i = skip_ws(text, nxt + len(TOOL_CALLS))
