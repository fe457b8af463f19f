"""Tool call parsers, one module per model family's format, chosen by `--tool-call-parser`."""

from __future__ import annotations

from engram.server.tool_parsers.base import ToolParser
from engram.server.tool_parsers.forced import NamedToolParser, RequiredToolParser
from engram.server.tool_parsers.hermes import HermesToolParser
from engram.server.tool_parsers.json_list import GraniteToolParser
from engram.server.tool_parsers.llama3_json import Llama3JsonToolParser
from engram.server.tool_parsers.mistral import MistralToolParser
from engram.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from engram.server.tool_parsers.stream import CallDelta, ToolCall, ToolCallReader

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,  # Qwen 2.5 and 3 write hermes' <tool_call> JSON
    "qwen3_coder": Qwen3CoderToolParser,
    "granite": GraniteToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}

__all__ = ["TOOL_PARSERS", "CallDelta", "NamedToolParser", "RequiredToolParser", "ToolCall", "ToolCallReader", "ToolParser"]
