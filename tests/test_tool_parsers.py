"""Tool call and reasoning parsers on recorded model outputs (the formats of Hermes/Qwen, Qwen3-Coder,
Granite, Llama 3, Mistral; Qwen3/DeepSeek-R1/Nemotron <think>, Granite's thought process): what a
whole reply holds, and that a stream's deltas, cut anywhere, add up to it."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from engram.args import ServerArgs
from engram.server.chat_reply import ReplyFormat, ReplyParsers
from engram.server.errors import APIError
from engram.server.reasoning_parsers import REASONING_PARSERS
from engram.server.tool_parsers import TOOL_PARSERS, NamedToolParser, RequiredToolParser
from engram.server.tools import NamedToolChoice, ToolDefinition

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}}},
    },
}
TOOLS = [
    WEATHER,
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]

# (parser, recorded reply, expected content, expected [(name, arguments)])
RECORDED = [
    (
        "hermes",
        'I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "I will look it up.",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"old\\" town", "days": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "",
        [("get_weather", {"city": 'Zürich "old" town', "days": 1}), ("get_time", {"zone": "CET"})],
    ),
    ("qwen", "It is sunny in Paris today.", "It is sunny in Paris today.", []),
    ("qwen", '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>', "", [("get_time", {"zone": "UTC"})]),
    (
        "qwen3_coder",
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "Let me check.",
        [("get_weather", {"city": "New York", "days": 2})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_time>\n<parameter=zone>\n0800\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
        "",
        [("get_time", {"zone": "0800"}), ("get_weather", {})],
    ),
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Boston", "units": "f"}}, {"name": "get_time", "arguments": {"zone": "EST"}}]',
        "",
        [("get_weather", {"city": "Boston", "units": "f"}), ("get_time", {"zone": "EST"})],
    ),
    ("granite", "No tools needed: 4.", "No tools needed: 4.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Lima", "days": 7}}', "", [("get_weather", {"city": "Lima", "days": 7})]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "PET"}}; {"name": "get_weather", "parameters": {}}',
        "",
        [("get_time", {"zone": "PET"}), ("get_weather", {})],
    ),
    ("llama3_json", "The answer is {probably} 4.", "The answer is {probably} 4.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "", [("get_weather", {"city": "Oslo"})]),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        "Sure.",
        [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "CET"})],
    ),
]


def _cuts(text: str, seed: int) -> list[int]:
    """Cut points: every character, and token-sized random pieces."""
    rng = random.Random(seed)
    if seed == 0:
        return list(range(1, len(text) + 1))
    cuts, at = [], 0
    while at < len(text):
        at = min(len(text), at + rng.randint(1, 6))
        cuts.append(at)
    return cuts


def streamed(fmt: ReplyFormat, text: str, seed: int) -> dict:
    """A stream's deltas added up: reasoning, content, and per call index its id, name, arguments."""
    reader = fmt.reader()
    out = {"reasoning": "", "content": "", "calls": {}}
    cuts = _cuts(text, seed)
    for k, at in enumerate(cuts):
        d = reader.feed(text[:at], final=k == len(cuts) - 1)
        out["reasoning"] += d.reasoning
        out["content"] += d.content
        for c in d.calls:
            call = out["calls"].setdefault(c.index, {"id": None, "name": None, "arguments": ""})
            if c.id is not None:
                assert call["id"] is None and c.name  # id and name come once, first
                call["id"], call["name"] = c.id, c.name
            assert call["id"] is not None
            call["arguments"] += c.arguments
    return out


@pytest.mark.parametrize(("parser", "text", "content", "calls"), RECORDED)
def test_a_recorded_reply_is_read_whole_and_streamed_alike(parser, text, content, calls):
    fmt = ReplyFormat(tools=TOOL_PARSERS[parser](TOOLS))
    reply = fmt.read(text)
    assert reply.content == content
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == calls
    assert all(c.id.startswith("call_") if parser != "mistral" else len(c.id) == 9 and c.id.isalnum() for c in reply.calls)
    assert len({c.id for c in reply.calls}) == len(reply.calls)
    for seed in range(4):
        s = streamed(fmt, text, seed)
        assert s["content"] == reply.content
        assert [(c["name"], c["arguments"]) for c in s["calls"].values()] == [(c.name, c.arguments) for c in reply.calls]


def test_a_call_cut_short_streams_what_the_whole_reply_holds():
    text = 'ok <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    fmt = ReplyFormat(tools=TOOL_PARSERS["hermes"](TOOLS))
    reply = fmt.read(text)
    assert reply.content == "ok" and [(c.name, c.arguments) for c in reply.calls] == [("get_weather", '{"city": "Par')]
    s = streamed(fmt, text, 0)
    assert s["content"] == "ok" and s["calls"][0]["arguments"] == '{"city": "Par'


def test_text_that_only_looks_like_a_call_is_content():
    for parser, text in (("hermes", "a <tool_call> b"), ("llama3_json", '{"no": "name"}'), ("granite", "<|tool_call|>not json")):
        fmt = ReplyFormat(tools=TOOL_PARSERS[parser](TOOLS))
        assert (fmt.read(text).content, fmt.read(text).calls) == (text, [])
        assert streamed(fmt, text, 0)["content"] == text


def test_content_holds_back_what_may_open_a_call():
    reader = ReplyFormat(tools=TOOL_PARSERS["hermes"](TOOLS)).reader()
    assert reader.feed("Hi <tool_", final=False).content == "Hi"
    assert reader.feed("Hi <tool_x", final=False).content == " <tool_x"


def test_forced_choices_read_their_schema_bound_replies():
    required = ReplyFormat(tools=RequiredToolParser(TOOLS))
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    assert [(c.name, c.arguments) for c in required.read(text).calls] == [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]
    named = ReplyFormat(tools=NamedToolParser("get_time"))
    assert [(c.name, c.arguments) for c in named.read('{"zone": "UTC"}').calls] == [("get_time", '{"zone": "UTC"}')]
    for fmt, reply in ((required, text), (named, '{"zone": "UTC"}')):
        assert [(c["name"], c["arguments"]) for c in streamed(fmt, reply, 1)["calls"].values()] == [
            (c.name, c.arguments) for c in fmt.read(reply).calls
        ]


REASONING = [
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", {}, "\nThe user wants 2+2.\n", "It is 4."),
    ("qwen3", "It is 4.", {}, "", "It is 4."),  # enable_thinking false: the template closed an empty block
    ("deepseek_r1", "Add them: 4.\n</think>\n\nThe answer is 4.", {}, "Add them: 4.\n", "The answer is 4."),
    ("deepseek_r1", "<think>Still thinking", {}, "Still thinking", ""),
    ("nemotron", "<think>\nsum\n</think>\n4", {}, "\nsum\n", "4"),
    ("nemotron", "4, no thinking", {"enable_thinking": False}, "", "4, no thinking"),
    ("granite", "Here is my thought process: 2 and 2 make 4. Here is my response: 4.", {}, " 2 and 2 make 4. ", "4."),
    ("granite", "Four.", {}, "", "Four."),
]


@pytest.mark.parametrize(("parser", "text", "kwargs", "reasoning", "content"), REASONING)
def test_reasoning_is_split_off_whole_and_streamed_alike(parser, text, kwargs, reasoning, content):
    fmt = ReplyFormat(reasoning=REASONING_PARSERS[parser](kwargs))
    reply = fmt.read(text)
    assert (reply.reasoning, reply.content) == (reasoning, content)
    for seed in range(4):
        s = streamed(fmt, text, seed)
        assert (s["reasoning"], s["content"]) == (reasoning, content)


def test_reasoning_then_a_tool_call():
    fmt = ReplyFormat(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"](TOOLS))
    text = '<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    reply = fmt.read(text)
    assert reply.reasoning == "\nNeed the weather.\n" and reply.content == ""
    assert [(c.name, c.arguments) for c in reply.calls] == [("get_weather", '{"city": "Rome"}')]
    s = streamed(fmt, text, 2)
    assert s["reasoning"] == reply.reasoning and s["calls"][0]["arguments"] == '{"city": "Rome"}'


def test_the_flags_offer_every_parser():
    """args.py lists the names itself (it is below the server, which it must not import)."""
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    assert fields["tool_call_parser"].metadata["choices"] == list(TOOL_PARSERS)
    assert fields["reasoning_parser"].metadata["choices"] == list(REASONING_PARSERS)


def test_auto_needs_the_flags_and_the_flags_need_each_other():
    tools = [ToolDefinition.model_validate(WEATHER)]
    with pytest.raises(APIError, match="enable-auto-tool-choice"):
        ReplyParsers(tool_call_parser="hermes").format(tools, "auto", {})
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ReplyParsers(enable_auto_tool_choice=True)
    assert ReplyParsers().format(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}}), {}).tools
    assert ReplyParsers().format(tools, "none", {}).plain
