"""Structured outputs over HTTP: OpenAI's response_format, vLLM's structured_outputs and guided_*
fields, SGLang's /generate sampling params; bad constraints are 400s naming their field; a
constrained turn of a conversation resumes exactly."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from server_utils import openai_client, running_server

MODEL = "m"
MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "role": {"enum": ["admin", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["id", "role", "tags"],
}


@pytest.fixture(scope="module")
def http(checkpoint_dir, tmp_path_factory):
    snapshots = str(tmp_path_factory.mktemp("snapshots"))
    with running_server(checkpoint_dir("granite"), MODEL, snapshot_dir=snapshots) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def test_response_format_json_schema_with_n_choices(http):
    client = openai_client(str(http.base_url))
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        n=3,
        seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}},
    )
    assert len(r.choices) == 3 and r.usage.prompt_tokens_details.cached_tokens == 0  # a short prompt: no shared prefill
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_a_streamed_constrained_answer_is_the_same_answer(http):
    client = openai_client(str(http.base_url))
    kw = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    )
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_json_object(http):
    client = openai_client(str(http.base_url))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, seed=1, response_format={"type": "json_object"})
    text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert text.startswith("{") and (reason == "length" or isinstance(json.loads(text), dict))


@pytest.mark.parametrize(
    ("fields", "matches"),
    [
        ({"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}}, r"[a-c]{3}-[0-9]{2}"),
        ({"structured_outputs": {"choice": ["up", "down"]}}, r"up|down"),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]?'}}, r"x[0-9]{1,2}"),
        ({"guided_regex": "[A-Z]{2}"}, r"[A-Z]{2}"),
        ({"guided_choice": ["left", "right"]}, r"left|right"),
        ({"guided_grammar": 'root ::= ("ab" | "cd")+ "."'}, r"(ab|cd)+\."),
        ({"regex": "q{1,4}"}, r"q{1,4}"),
        ({"ebnf": 'root ::= "<" [a-z] ">"'}, r"<[a-z]>"),
        ({"guided_json": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}}, r"\{\s*\"b\"\s*:\s*(true|false)\s*\}"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [1, 2]}}}}, r"1|2"),
    ],
)
def test_completions_follow_every_form_of_constraint(http, fields, matches):
    for seed in range(4):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Answer: ", "max_tokens": 400, "seed": seed, **fields})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert re.fullmatch(matches, choice["text"]) and choice["finish_reason"] == "stop", choice


@pytest.mark.parametrize(
    ("params", "matches"),
    [
        (
            {"json_schema": json.dumps({"type": "object", "properties": {"k": {"enum": ["v", "w"]}}, "required": ["k"]})},
            r"\{\s*\"k\"\s*:\s*\"[vw]\"\s*\}",
        ),
        ({"regex": "[0-9]{3}"}, r"[0-9]{3}"),
        ({"ebnf": 'root ::= "yes" | "no"'}, r"yes|no"),
    ],
)
def test_generate_follows_sglang_constraints(http, params, matches):
    for seed in range(3):
        r = http.post("/generate", json={"text": "Q: ", "sampling_params": {"max_new_tokens": 300, "sampling_seed": seed, **params}})
        assert r.status_code == 200, r.text
        assert re.fullmatch(matches, r.json()["text"]) and r.json()["meta_info"]["finish_reason"]["type"] == "stop"


CHAT = {"model": MODEL, "messages": MESSAGES}


@pytest.mark.parametrize(
    ("route", "body", "param", "says"),
    [
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
            'Unsupported type "nope"',
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, "n": 2},
            "response_format.json_schema.schema",
            'Unsupported type "nope"',
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "guided_regex": "a(b"}, "guided_regex", "parenthesis is not closed"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "structured_outputs": {"grammar": "root ::= nothing"}},
            "structured_outputs.grammar",
            'Rule "nothing" is not defined',
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "guided_json": "{oops"}, "guided_json", "not valid JSON"),
        ("/generate", {"text": "a", "sampling_params": {"ebnf": "root ::= ("}}, "sampling_params.ebnf", "EBNF parser error"),
        ("/generate", {"text": "a", "sampling_params": {"json_schema": '{"type": "nope"}'}}, "sampling_params.json_schema", "nope"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(http, route, body, param, says):
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param) and says in error["message"], error


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
            "at most one output constraint; got response_format, guided_regex",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs: give exactly one of json, regex, choice, grammar, json_object (got regex, choice)",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "structured_outputs": {"choice": ["b"]}, "ebnf": 'root ::= "a"'},
            "got structured_outputs.choice, ebnf",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "guided_choice": []}, "guided_choice: the list of choices is empty"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "guided_regex": 5}, "guided_regex"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "json_schema is given with type 'json_schema'"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ("/v1/chat/completions", {**CHAT, "json_schema": {"type": "object"}}, "json_schema: send response_format"),
        ("/generate", {"text": "a", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "got sampling_params.regex, sampling_params.ebnf"),
    ],
)
def test_conflicting_or_malformed_constraints_are_400s(http, route, body, says):
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"], r.json()


def test_a_constrained_turn_resumes_exactly(http):
    """The next turn equals /generate over the whole history, the constrained reply included."""
    first = http.post(
        "/v1/chat/completions",
        json={
            **CHAT,
            "conversation_id": "c",
            "temperature": 0,
            "max_tokens": 200,
            "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True},
        },
    )
    assert first.status_code == 200, first.text
    jsonschema.validate(json.loads(first.json()["choices"][0]["message"]["content"]), SCHEMA)
    second = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "And another?"}], "conversation_id": "c", "temperature": 0, "max_tokens": 12},
    )
    assert second.status_code == 200, second.text
    reply = second.json()["usage"]["completion_tokens"]
    info = http.post("/get_snapshot_info", json={"conversation_id": "c", "turn_number": 2}).json()
    prompt = info["fill_ids"][: len(info["fill_ids"]) - reply]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    full = http.post("/generate", json={"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 12}}).json()
    assert full["output_ids"] == info["fill_ids"][len(prompt) :]
    assert full["text"] == second.json()["choices"][0]["message"]["content"]
