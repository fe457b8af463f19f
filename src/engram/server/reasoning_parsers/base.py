"""Reasoning between markers: a reply split into its reasoning and its answer (content).

`split` reads the reply so far; read again with more text, both parts only grow, so a stream
sends what grew and the whole reply read once gives what the deltas add up to.
"""

from __future__ import annotations

from typing import Any

from engram.server.tool_parsers.base import held_back


class ReasoningParser:
    starts: tuple[str, ...] = ()
    ends: tuple[str, ...] = ()
    # The reasoning may begin without a start marker (a template that opens it in the prompt):
    # then everything up to an end marker is reasoning, and all of an unended reply.
    implicit_start = False

    def __init__(self, template_kwargs: dict[str, Any] | None = None) -> None:
        self.template_kwargs = template_kwargs or {}

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the reply so far."""
        lead = len(text) - len(text.lstrip())
        body = text[lead:]
        start = next((m for m in self.starts if body.startswith(m)), None)
        if start is not None:
            rest = body[len(start) :]
        elif not final and any(m.startswith(body) for m in self.starts):
            return "", ""  # a start marker may be coming
        elif self.implicit_start:
            rest = text
        else:
            return "", text
        found = [(rest.find(m), m) for m in self.ends if m in rest]
        if found:
            at, end = min(found)
            return rest[:at], rest[at + len(end) :].lstrip()
        return (rest if final else held_back(rest, *self.ends)), ""
