"""Granite 3.2 and later with `thinking: true`: "Here is my thought process:" then the reasoning,
"Here is my response:" then the answer ("Here's" for either)."""

from __future__ import annotations

from engram.server.reasoning_parsers.base import ReasoningParser


class GraniteReasoningParser(ReasoningParser):
    starts = ("Here is my thought process:", "Here's my thought process:")
    ends = ("Here is my response:", "Here's my response:")
