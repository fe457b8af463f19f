"""Big requests: a body over --max-request-bytes is refused before it is parsed, a prompt too long
for the context before it is tokenized, and tokenizing one below the limits leaves the event loop
free (/health answers meanwhile)."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_utils import running_server

from engram.models.embedded import ensure_embedded_model

MODEL = "tiny-hybrid"
MAX_BYTES = 64 << 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "engram-cache"
    with running_server(ensure_embedded_model(cache), MODEL, max_request_bytes=MAX_BYTES, snapshot_dir=str(tmp_path_factory.mktemp("s"))) as srv:
        yield srv


@pytest.fixture
def tokenizer_calls(server, monkeypatch):
    """Each text the server tokenizes, and an optional gate every call waits at."""
    tokenizer = server.app.state.serving.tokenizer
    calls, gate, entered = [], threading.Event(), threading.Event()
    gate.set()
    original = tokenizer.encode

    def encode(text, **kwargs):
        calls.append(text)
        entered.set()
        assert gate.wait(30), "the test never opened the gate"
        return original(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    yield calls, gate, entered
    gate.set()


def test_a_body_over_the_limit_is_413_before_it_is_parsed(server, tokenizer_calls):
    body = b'{"text": "' + b"a" * MAX_BYTES + b'"}'
    declared = httpx.post(server.url + "/generate", content=body, headers={"content-type": "application/json"})
    streamed = httpx.post(
        server.url + "/generate",
        content=iter([body[:1000], body[1000:]]),  # chunked: no Content-Length
        headers={"content-type": "application/json"},
    )
    for r in (declared, streamed):
        assert r.status_code == 413, r.text
        assert "--max-request-bytes" in r.json()["error"]["message"] and str(MAX_BYTES) in r.json()["error"]["message"]
    assert tokenizer_calls[0] == []
    small = httpx.post(
        server.url + "/generate",
        content=iter([b'{"text": "hi", ', b'"sampling_params": {"max_new_tokens": 1}}']),
        headers={"content-type": "application/json"},
    )
    assert small.status_code == 200, small.text


@pytest.mark.parametrize(
    ("route", "field"), [("/generate", "text"), ("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"), ("/tokenize", "prompt")]
)
def test_a_prompt_longer_than_the_context_can_hold_is_refused_untokenized(server, tokenizer_calls, route, field):
    limit = server.app.state.serving.max_prompt_chars
    text = "a" * (limit + 1)
    body = {"model": MODEL, **({"messages": [{"role": "user", "content": text}]} if field == "messages" else {field: text})}
    r = httpx.post(server.url + route, json=body)
    assert r.status_code == 400 and f"more than the {limit} that the context of 1024 tokens can hold" in r.text, r.text
    assert tokenizer_calls[0] == []


def bodies(text: str) -> dict[str, dict]:
    messages = [{"role": "user", "content": text}]
    return {
        "/generate": {"text": text, "sampling_params": {"max_new_tokens": 1}},
        "/v1/completions": {"model": MODEL, "prompt": text, "max_tokens": 1},
        "/v1/chat/completions": {"model": MODEL, "messages": messages, "max_tokens": 1},
        "/tokenize": {"model": MODEL, "messages": messages},
        "conversation": {"model": MODEL, "messages": messages, "max_tokens": 1, "conversation_id": "big"},
    }


@pytest.mark.parametrize("route", list(bodies("")))
def test_health_answers_while_a_big_prompt_is_tokenized(server, tokenizer_calls, route):
    """Tokenizing holds the request (at a gate the test opens): /health must answer meanwhile,
    which it cannot if the tokenizer runs on the event loop."""
    calls, gate, entered = tokenizer_calls
    text = "big prompt " * 80  # within the context: the gate stands in for a slow tokenizer
    body = bodies(text)[route]
    answer: list[httpx.Response] = []
    gate.clear()
    big = threading.Thread(
        target=lambda: answer.append(httpx.post(server.url + route.replace("conversation", "/v1/chat/completions"), json=body, timeout=60))
    )
    big.start()
    try:
        assert entered.wait(30)
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200 and big.is_alive() and not answer  # answered while the big one was held
    finally:
        gate.set()
        big.join()
    assert answer[0].status_code == 200, answer[0].text
    assert any(text in call for call in calls)
