"""Qwen3-Coder: XML calls, `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`.

The arguments object is built from the parameters, each added whole once its closing tag has come:
a parameter declared `string` in the tool's schema (or not declared) stays text; any other is
read as JSON (a number, boolean, object, array) and stays text if it is not JSON.
"""

from __future__ import annotations

import json
from typing import Any

from engram.server.tool_parsers.base import PartialCall
from engram.server.tool_parsers.hermes import HermesToolParser
from engram.server.tool_parsers.json_scan import skip_ws

FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"


class Qwen3CoderToolParser(HermesToolParser):
    def scan_call(self, text: str, i: int, calls: list[PartialCall]) -> int | None:
        if not text.startswith(FUNCTION, i):
            if FUNCTION.startswith(text[i:]):
                return None
            raise ValueError(f"expected {FUNCTION} after <tool_call>")
        name_end = text.find(">", i + len(FUNCTION))
        if name_end < 0:
            return None
        name = text[i + len(FUNCTION) : name_end].strip()
        call = PartialCall(name, "{")
        calls.append(call)
        fields: list[str] = []
        j = skip_ws(text, name_end + 1)
        while j < len(text):
            if text.startswith(END_FUNCTION, j):
                call.arguments = "{" + ", ".join(fields) + "}"
                return j + len(END_FUNCTION)
            if not text.startswith(PARAMETER, j):
                if PARAMETER.startswith(text[j:]) or END_FUNCTION.startswith(text[j:]):
                    return None
                raise ValueError(f"expected {PARAMETER} or {END_FUNCTION} in the call of {name!r}")
            key_end = text.find(">", j + len(PARAMETER))
            value_end = text.find(END_PARAMETER, key_end + 1) if key_end >= 0 else -1
            if value_end < 0:
                return None
            key = text[j + len(PARAMETER) : key_end].strip()
            value = self._value(name, key, _strip_newline(text[key_end + 1 : value_end]))
            fields.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            call.arguments = "{" + ", ".join(fields)
            j = skip_ws(text, value_end + len(END_PARAMETER))
        return None

    def _value(self, function: str, key: str, text: str) -> Any:
        schema = next((t.get("function", {}).get("parameters") or {} for t in self.tools if t.get("function", {}).get("name") == function), {})
        kind = (schema.get("properties") or {}).get(key, {}).get("type", "string")
        if kind == "string":
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text


def _strip_newline(text: str) -> str:
    """The value without the one newline that the format puts on each side of it."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text
