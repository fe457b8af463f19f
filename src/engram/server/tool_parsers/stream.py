"""Successive scans of a growing reply turned into deltas: text outside the calls, and for each
call its id and name first, then fragments of its arguments. Fed the whole reply at once, a
reader gives what a stream's deltas add up to."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from engram.server.tool_parsers.base import Scan, ToolParser

log = logging.getLogger(__name__)


@dataclass
class CallDelta:
    index: int
    id: str | None = None  # with the name, in the call's first delta
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class ToolDeltas:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ToolCallReader:
    """One reply's reader: `feed` it the reply's whole text so far, each time longer."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None, id_prefix: str | None = None) -> None:
        self.parser = parser
        self.id_prefix = id_prefix or f"call_{uuid.uuid4().hex[:24]}"  # the parser's call_id makes call i's id of it
        self.max_calls = max_calls  # the calls past it are dropped (OpenAI's parallel_tool_calls false: one)
        self.content = ""
        self.calls: list[ToolCall] = []
        self.failed = False  # the reply is not in the parser's format: all of it is content

    def feed(self, text: str, final: bool) -> ToolDeltas:
        if not self.failed:
            try:
                return self._deltas(self.parser.scan(text, final))
            except ValueError as e:
                log.debug("a reply is not in the tool call format (%s): it is content", e)
                self.failed = True
        if self.calls or not text.startswith(self.content):
            return ToolDeltas()  # calls went out already: the rest cannot be told apart any more
        return self._content_delta(text)

    def _deltas(self, scan: Scan) -> ToolDeltas:
        out = self._content_delta(scan.content)
        for index, call in enumerate(scan.calls[: self.max_calls]):
            if call.name is None:
                break  # a call's name goes out before its arguments, and calls in order
            if index == len(self.calls):
                self.calls.append(ToolCall(self.parser.call_id(self.id_prefix, index), call.name, ""))
                out.calls.append(CallDelta(index, self.calls[index].id, call.name))
            sent = self.calls[index]
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                grown = call.arguments[len(sent.arguments) :]
                sent.arguments = call.arguments
                if out.calls and out.calls[-1].index == index:
                    out.calls[-1].arguments += grown
                else:
                    out.calls.append(CallDelta(index, arguments=grown))
        return out

    def _content_delta(self, content: str) -> ToolDeltas:
        if len(content) > len(self.content) and content.startswith(self.content):
            grown, self.content = content[len(self.content) :], content
            return ToolDeltas(content=grown)
        return ToolDeltas()
