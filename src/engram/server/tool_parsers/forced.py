"""The replies of a forced tool choice, held to a schema by the grammar (server/tools.py):
`required` writes the call list itself, a named function only its arguments."""

from __future__ import annotations

from engram.server.tool_parsers.base import PartialCall, Scan, ToolParser
from engram.server.tool_parsers.json_list import JsonListToolParser


class RequiredToolParser(JsonListToolParser):
    """`[{"name": ..., "parameters": {...}}, ...]`."""


class NamedToolParser(ToolParser):
    """The reply is the arguments of the one call of `name`."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", [PartialCall(self.name, text)])
