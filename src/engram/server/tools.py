"""Tool definitions and tool choice of a chat request (OpenAI's, and the deprecated `functions` /
`function_call`), the grammar of a forced choice, and the tool call shapes of messages and replies.

`tool_choice: "required"` holds the reply to a JSON array of calls and a named function to that
function's arguments (vLLM's way): both always parse, and their arguments follow the tool's
parameters schema. `auto` leaves the model free and reads its calls with `--tool-call-parser`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from engram.engine.request import StructuredOutputsParams

FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"  # anchored: pydantic searches a pattern
NO_PARAMETERS = {"type": "object", "properties": {}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallMessage(_Strict):
    """A call in an assistant message (sent back by the client, or in a reply)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


def resolve_tools(
    tools: list[ToolDefinition] | None,
    tool_choice: ToolChoice | None,
    functions: list[FunctionDefinition] | None,
    function_call: Literal["none", "auto"] | FunctionName | None,
) -> tuple[list[ToolDefinition], ToolChoice]:
    """The request's tools and choice, the deprecated fields mapped to the current ones. Without a
    choice, "auto" when there are tools (OpenAI's default), else "none". Raises ValueError."""
    if functions is not None or function_call is not None:
        if tools is not None or tool_choice is not None:
            raise ValueError("functions and function_call are the deprecated form of tools and tool_choice: send one form")
        tools = [ToolDefinition(type="function", function=f) for f in functions or []]
        tool_choice = NamedToolChoice(type="function", function=function_call) if isinstance(function_call, FunctionName) else function_call
    tools = tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise ValueError("tools: two tools have the same name")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice != "none" and not tools:
        raise ValueError("tool_choice: a tool choice other than 'none' needs tools")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise ValueError(f"tool_choice: the function {tool_choice.function.name!r} is not among the tools")
    return tools, tool_choice


def tool_grammar(tools: list[ToolDefinition], tool_choice: ToolChoice, parallel: bool = True) -> StructuredOutputsParams | None:
    """The schema a forced choice holds the reply to (compact JSON: no whitespace of its own);
    `parallel` false (OpenAI's parallel_tool_calls) allows one call."""
    if isinstance(tool_choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return StructuredOutputsParams(json=tool.function.parameters or NO_PARAMETERS, disable_any_whitespace=True, source="tool_choice")
    if tool_choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": t.function.parameters or NO_PARAMETERS},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True, source="tool_choice")


def template_tool_calls(calls: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """(id, name, arguments) as chat templates read them: arguments as an object when they are JSON
    (templates write `arguments | tojson`), as sent otherwise."""
    out = []
    for call_id, name, arguments in calls:
        try:
            args: Any = json.loads(arguments)
        except json.JSONDecodeError:
            args = arguments
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    return out
