"""Tool calling and reasoning over HTTP with a tiny random model: forced choices (required, a named
function, the deprecated function_call) always give calls whose arguments validate against the
tool's schema; `auto` reads a recorded reply (the model held to it by a choice grammar) with
--tool-call-parser and --reasoning-parser, streamed and not; bad tool fields are 400s naming them."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_utils import ServerProcess, openai_client, running_server

from engram.server.protocol import ChatCompletionRequest

MODEL = "m"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}, "hourly": {"type": "boolean"}},
    "required": ["city", "days"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
RECORDED = (
    "<think>\nThe user asks for the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)


def test_an_unvalidated_request_has_the_default_tool_setup():
    """The resolved tools and choice are private attributes: `model_construct`, which runs no
    validator, leaves their defaults (no tools, choice "none")."""
    assert ChatCompletionRequest.model_construct(messages=[]).tool_setup() == ([], "none")


@pytest.fixture(scope="module")
def server(checkpoint_dir, tmp_path_factory):
    snapshots = str(tmp_path_factory.mktemp("snapshots"))
    with running_server(
        checkpoint_dir("granite"), MODEL, snapshot_dir=snapshots, tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="nemotron"
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def streamed_message(chunks) -> dict:
    """A stream's deltas added up into a message: content, reasoning, calls by index."""
    message = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            message["content"] += delta.content or ""
            message["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = message["tool_calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id is not None:
                    assert entry["id"] is None and call.function.name and call.type == "function"
                    entry["id"], entry["name"] = call.id, call.function.name
                entry["arguments"] += call.function.arguments or ""
            message["finish_reason"] = choice.finish_reason or message.get("finish_reason")
    return message


def valid_calls(calls) -> list[str]:
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [call.function.name for call in calls]


@pytest.mark.parametrize("seed", range(6))
def test_tool_choice_required_always_gives_a_valid_call(client, seed):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=140, seed=seed, temperature=1.0, parallel_tool_calls=False
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(valid_calls(choice.message.tool_calls)) == 1


@pytest.mark.parametrize("seed", range(3))
def test_parallel_required_calls_are_valid_but_one_cut_short(client, seed):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=140, seed=seed, temperature=1.0
    )
    choice = r.choices[0]
    calls = choice.message.tool_calls
    assert choice.finish_reason in ("tool_calls", "length") and calls
    valid_calls(calls if choice.finish_reason == "tool_calls" else calls[:-1])  # a reply cut by max_tokens ends mid-call


@pytest.mark.parametrize("seed", range(4))
def test_a_named_tool_choice_always_calls_it_validly_streamed_too(client, seed):
    kw = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=140,
        seed=seed,
        temperature=1.0,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    assert valid_calls(whole.message.tool_calls) == ["get_time"] and whole.finish_reason == "tool_calls"
    s = streamed_message(client.chat.completions.create(**kw, stream=True))
    assert [(c["name"], c["arguments"]) for c in s["tool_calls"].values()] == [
        ("get_time", whole.message.tool_calls[0].function.arguments)
    ]  # seeded: the same reply
    assert s["finish_reason"] == "tool_calls" and s["content"] == ""


def test_the_deprecated_function_call_names_a_function(client):
    functions = [t["function"] for t in TOOLS]
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, functions=functions, function_call={"name": "get_weather"}, max_tokens=140, seed=1
    )
    assert valid_calls(r.choices[0].message.tool_calls) == ["get_weather"]


def test_auto_reads_a_recorded_reply_streamed_and_not(client):
    kw = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS[:1],
        tool_choice="auto",
        max_tokens=250,
        temperature=0,
        extra_body={"structured_outputs": {"choice": [RECORDED]}},
    )
    choice = client.chat.completions.create(**kw).choices[0]
    message = choice.message
    assert choice.finish_reason == "tool_calls" and message.content == "Let me check."
    assert message.model_extra["reasoning_content"] == "\nThe user asks for the weather.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("get_weather", {"city": "Paris", "days": 2})]
    s = streamed_message(client.chat.completions.create(**kw, stream=True))
    assert (s["content"], s["reasoning_content"], s["finish_reason"]) == (message.content, message.model_extra["reasoning_content"], "tool_calls")
    assert [(c["name"], c["arguments"]) for c in s["tool_calls"].values()] == [("get_weather", message.tool_calls[0].function.arguments)]


def test_tool_choice_none_reads_no_calls_but_still_splits_reasoning(client):
    kw = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS[:1],
        tool_choice="none",
        max_tokens=250,
        temperature=0,
        extra_body={"structured_outputs": {"choice": [RECORDED]}},
    )
    message = client.chat.completions.create(**kw).choices[0].message
    assert message.tool_calls is None and message.content.startswith("Let me check.\n<tool_call>")
    thinking_off = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}})
    assert thinking_off.choices[0].message.content == RECORDED  # nemotron without thinking: all content


def test_chat_template_kwargs_hold_within_a_conversation(client):
    """Refused with a conversation_id before: now every rendering of the turn gets them, and the
    reasoning parser reads them (nemotron without thinking: the reply is all content)."""
    kw = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=250,
        temperature=0,
        extra_body={"structured_outputs": {"choice": [RECORDED]}, "conversation_id": "thinking"},
    )
    off = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}})
    assert off.choices[0].message.content == RECORDED and off.model_extra["turn"] == 1
    on = client.chat.completions.create(**kw)
    assert on.model_extra["turn"] == 2 and on.choices[0].message.model_extra["reasoning_content"].startswith("\nThe user asks")
    assert on.usage.prompt_tokens_details.cached_tokens > 0


def test_a_retried_tool_call_turn_is_answered_with_the_same_calls(server):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 140,
        "seed": 5,
        "conversation_id": "retried",
    }
    first, again = (httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Idempotency-Key": "k1"}).json() for _ in range(2))
    assert first["choices"][0]["finish_reason"] == "tool_calls" and first["choices"][0]["message"]["tool_calls"]
    assert again["choices"] == first["choices"] and again["turn"] == first["turn"] == 1


def test_a_streamed_call_turn_is_recorded_with_the_ids_it_streamed(client):
    """The client builds the assistant message from the stream's deltas and sends the whole
    conversation back: it is the recorded history, so only the tool result is new."""
    kw = dict(model=MODEL, tools=TOOLS, temperature=0, extra_body={"conversation_id": "streamed"})
    s = streamed_message(
        client.chat.completions.create(messages=MESSAGES, tool_choice="required", parallel_tool_calls=False, max_tokens=140, stream=True, **kw)
    )
    (call,) = s["tool_calls"].values()
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}],
    }
    messages = [*MESSAGES, assistant, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    answer = client.chat.completions.create(messages=messages, tool_choice="none", max_tokens=4, **kw)
    assert answer.model_extra["turn"] == 2 and answer.usage.prompt_tokens_details.cached_tokens > 0


def test_tools_are_rendered_by_the_chat_template(server):
    with_tools = httpx.post(
        server.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1}
    ).json()
    without = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1}).json()
    tools_text = "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + len(tools_text.encode())


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice: the function 'nope'"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "none"}, "tools"),
        ({"tools": TOOLS + TOOLS[:1], "tool_choice": "none"}, "tools: two tools have the same name"),
        ({"tools": TOOLS, "functions": [TOOLS[0]["function"]]}, "functions and function_call are the deprecated form"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "give at most one output constraint; got response_format, tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]}, "arguments"),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(server, body, says):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


def test_the_openai_tool_loop_continues_a_conversation_across_a_restart(checkpoint_dir, tmp_path):
    """Call, tool result, answer inside one conversation_id conversation, the server restarted after
    the call. The call turn is recorded as the assistant message with tool_calls (the client sends
    the whole conversation back and only the tool result is new), `on_tool_call` snapshots it
    because the parser found a call, and the answer after the restart resumes from that snapshot
    exactly: it equals a full prefill of the same tokens."""
    server = ServerProcess(
        [
            "--model-path",
            checkpoint_dir("granite"),
            "--served-model-name",
            MODEL,
            "--snapshot-dir",
            str(tmp_path / "s"),
            "--snapshot-trigger-policy",
            "on_tool_call",
            "--tool-call-parser",
            "hermes",
            "--enable-auto-tool-choice",
            "--max-total-tokens",
            "4096",
            "--context-length",
            "2048",
            "--log-level",
            "warning",
        ],
        tmp_path / "server.log",
    )
    server.start()
    try:
        client = openai_client(server.url)
        messages = list(MESSAGES)
        kw = dict(model=MODEL, tools=TOOLS, temperature=0, extra_body={"conversation_id": "agent"})
        first = client.chat.completions.create(messages=messages, tool_choice="required", parallel_tool_calls=False, max_tokens=200, **kw)
        (call,) = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls" and valid_calls([call]) == [call.function.name]
        with httpx.Client(base_url=server.url, timeout=60) as http:
            called = http.post("/get_snapshot_info", json={"conversation_id": "agent"})
            assert called.status_code == 200, called.text  # on_tool_call: the turn with a call was written
        messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
        server.stop()
        server.start()

        answer = client.chat.completions.create(messages=messages, tool_choice="none", max_tokens=8, **kw)
        assert answer.model_extra["turn"] == 2 and answer.choices[0].message.tool_calls is None
        assert answer.usage.prompt_tokens_details.cached_tokens == called.json()["state_len"]
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.post("/save_snapshot", json={"conversation_id": "agent"}).status_code == 200
            ids = http.post("/get_snapshot_info", json={"conversation_id": "agent"}).json()["fill_ids"]
            prompt = ids[: len(ids) - answer.usage.completion_tokens]
            assert prompt[: len(called.json()["fill_ids"])] == called.json()["fill_ids"]
            full = http.post("/generate", json={"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}).json()
            assert full["output_ids"] == ids[len(prompt) :]
    finally:
        server.kill()
