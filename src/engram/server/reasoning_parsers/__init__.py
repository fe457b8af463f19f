"""Reasoning parsers, chosen by `--reasoning-parser`."""

from __future__ import annotations

from engram.server.reasoning_parsers.base import ReasoningParser
from engram.server.reasoning_parsers.granite import GraniteReasoningParser
from engram.server.reasoning_parsers.think import DeepSeekR1ReasoningParser, NemotronReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "granite": GraniteReasoningParser,
    "nemotron": NemotronReasoningParser,
}

__all__ = ["REASONING_PARSERS", "ReasoningParser"]
