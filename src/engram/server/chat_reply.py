"""A chat reply read into reasoning, content and tool calls, whole or as it streams.

The reasoning parser (`--reasoning-parser`) splits the reasoning off first; the rest goes to the
request's tool parser (`--tool-call-parser` under `tool_choice: "auto"`, or the forced choice's).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from engram.server.errors import APIError
from engram.server.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from engram.server.tool_parsers import TOOL_PARSERS, CallDelta, NamedToolParser, RequiredToolParser, ToolCall, ToolCallReader, ToolParser
from engram.server.tools import NamedToolChoice, ToolChoice, ToolDefinition, template_tool_calls


@dataclass
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class Reply:
    reasoning: str | None
    content: str
    calls: list[ToolCall]

    def message(self) -> dict[str, Any]:
        """The reply as a conversation records it: the message a client sends back (without reasoning)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = template_tool_calls([(c.id, c.name, c.arguments) for c in self.calls])
        return message


@dataclass(frozen=True)
class ReplyFormat:
    """How one request's replies are read (the parsers are stateless; each reply gets a reader).
    A call's id depends only on `call_ids` (random per request; a conversation turn's follow from
    its conversation, branch and turn, so that a retry answered from the record names the same
    calls), the choice and the call's index: the response, its stream and the record agree."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    max_calls: int | None = None
    call_ids: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tools is None

    def reader(self, choice: int = 0) -> ReplyReader:
        return ReplyReader(self, f"call_{self.call_ids}_{choice}")

    def read(self, text: str, choice: int = 0) -> Reply:
        reader = self.reader(choice)
        reader.feed(text, final=True)
        return reader.reply()


class ReplyReader:
    def __init__(self, fmt: ReplyFormat, id_prefix: str) -> None:
        self.fmt = fmt
        self.reasoning = ""
        self.tools = ToolCallReader(fmt.tools, fmt.max_calls, id_prefix) if fmt.tools is not None else None
        self.content = ""

    def feed(self, text: str, final: bool) -> ReplyDelta:
        """What the reply's text so far adds to what earlier calls returned."""
        reasoning, content = self.fmt.reasoning.split(text, final) if self.fmt.reasoning is not None else ("", text)
        delta = ReplyDelta()
        if reasoning.startswith(self.reasoning):
            delta.reasoning, self.reasoning = reasoning[len(self.reasoning) :], reasoning
        if self.tools is not None:
            tools = self.tools.feed(content, final)
            delta.content, delta.calls = tools.content, tools.calls
        elif content.startswith(self.content):
            delta.content = content[len(self.content) :]
        self.content += delta.content
        return delta

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def reply(self) -> Reply:
        return Reply(self.reasoning if self.fmt.reasoning is not None else None, self.content, self.calls)


@dataclass(frozen=True)
class ReplyParsers:
    """The server's parser flags."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser: {self.tool_call_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser: {self.reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")

    def format(
        self, tools: list[ToolDefinition], tool_choice: ToolChoice, template_kwargs: dict[str, Any], parallel_tool_calls: bool = True
    ) -> ReplyFormat:
        """The reply format of a request. A forced choice's reply is all call (no reasoning to split off)."""
        definitions = [t.model_dump() for t in tools]
        if isinstance(tool_choice, NamedToolChoice):
            return ReplyFormat(tools=NamedToolParser(tool_choice.function.name))
        if tool_choice == "required":
            return ReplyFormat(tools=RequiredToolParser(definitions))
        reasoning = REASONING_PARSERS[self.reasoning_parser](template_kwargs) if self.reasoning_parser is not None else None
        if tool_choice == "none":
            return ReplyFormat(reasoning=reasoning)
        if not self.enable_auto_tool_choice or self.tool_call_parser is None:
            raise APIError(
                400, '"auto" tool choice needs a server started with --enable-auto-tool-choice and --tool-call-parser', param="tool_choice"
            )
        return ReplyFormat(reasoning, TOOL_PARSERS[self.tool_call_parser](definitions), None if parallel_tool_calls else 1)
