"""The SGLang-native routes over plain HTTP, cancellation on disconnect, and responsiveness."""

from __future__ import annotations

import gc
import json
import threading
import time

import httpx
import pytest
from server_utils import metric_value, running_server

from engram.models.embedded import ensure_embedded_model
from engram.state.sequence_state import SequenceState

MODEL = "tiny-hybrid"
LONG = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}
LONG_OPENAI = {"max_tokens": LONG["max_new_tokens"], "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(ensure_embedded_model(tmp_path_factory.getbasetemp() / "engram-cache"), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def engine_of(server):
    return server.app.state.serving.engine


def wait_until_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine_of(server).stats().num_running or engine_of(server).stats().num_waiting:
        assert time.monotonic() < deadline, f"still busy: {engine_of(server).stats()}"
        time.sleep(0.02)


def sse_events(response: httpx.Response) -> list:
    events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_generate_text(http):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == meta["completion_tokens"] == 10
    assert meta["prompt_tokens"] == 5 and meta["cached_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 10}
    assert isinstance(out["text"], str) and meta["e2e_latency"] > 0
    assert http.post("/generate", json=body).json()["text"] == out["text"]  # greedy is deterministic


def test_generate_input_ids_matches_text(http):
    params = {"max_new_tokens": 8, "temperature": 0}
    by_text = http.post("/generate", json={"text": "abc", "sampling_params": params}).json()
    by_ids = http.post("/generate", json={"input_ids": list(b"abc"), "sampling_params": params, "rid": "my-rid"}).json()
    assert by_ids["output_ids"] == by_text["output_ids"] and by_ids["text"] == by_text["text"]
    assert by_ids["meta_info"]["id"] == "my-rid"


def test_generate_logprobs(http):
    body = {
        "text": "abc",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    out = http.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_generate_stream(http):
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}, "stream": True}
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert len(events) >= 2
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, like SGLang
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    final = events[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 6
    body["stream"] = False
    assert http.post("/generate", json=body).json()["text"] == final["text"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"sampling_params": {"max_new_tokens": 2}}, "exactly one of text and input_ids"),
        ({"text": "a", "input_ids": [1]}, "exactly one of text and input_ids"),
        ({"text": "a", "sampling_params": {"max_tokens": 5}}, "max_tokens"),  # SGLang's name is max_new_tokens
        ({"text": "a", "rid": ["r1"]}, "rid"),
        ({"text": [], "sampling_params": {"n": 2}}, "text"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [70000]}, "vocabulary"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 5000}}, "context length"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ],
)
def test_generate_bad_requests(http, body, says):
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


def test_health_and_info(http, server):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["served_model_name"] == MODEL and info["is_generation"]
    assert info["context_length"] == 1024 and "attention" in info["layers"] and "mamba" in info["layers"]
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"]


def test_every_operation_has_its_own_id_and_flush_cache_takes_both_methods(http):
    """Generated clients name their methods by operation id: a repeated one is dropped or clashes."""
    schema = http.get("/openapi.json").json()
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert {"get", "post"} <= set(schema["paths"]["/flush_cache"])
    assert http.get("/flush_cache").json()["success"] and http.post("/flush_cache").json()["success"]


def test_version_and_server_info(http):
    version = http.get("/version").json()["version"]
    info = http.get("/get_server_info").json()
    assert info["version"] == version and info["server_args"]["served_model_name"] == MODEL
    assert not info["server_args"]["api_key"] and "max_running_requests" in info["engine_args"]


def test_abort_request_by_rid(http, server):
    result = {}
    body = {"text": "abc", "rid": "to-abort", "sampling_params": LONG}
    worker = threading.Thread(target=lambda: result.update(http.post("/generate", json=body).json()))
    worker.start()
    deadline = time.monotonic() + 10
    while engine_of(server).engine.stats().num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert http.post("/abort_request", json={"rid": "to-abort"}).json() == {"success": True}
    worker.join(timeout=30)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result["output_ids"]) < LONG["max_new_tokens"]
    assert http.post("/abort_request", json={}).status_code == 400  # neither a rid nor abort_all


def test_metrics(http):
    http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    text = http.get("/metrics").text
    for family in (
        "num_running_reqs",
        "num_queue_reqs",
        "prompt_tokens_total",
        "generation_tokens_total",
        "cached_tokens_total",
        "prefill_throughput",
        "gen_throughput",
        "state_slots_used",
        "state_pool_usage",
        "kv_blocks_used",
        "kv_pool_usage",
    ):
        assert f'\nengram:{family}{{model_name="{MODEL}"}} ' in text, family
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert f'\nengram:{histogram}_count{{model_name="{MODEL}"}} ' in text, histogram
    count = float(text.split(f'\nengram:time_to_first_token_seconds_count{{model_name="{MODEL}"}} ')[1].split()[0])
    assert count >= 1


def test_streaming_disconnect_aborts_and_health_stays_fast(http, server):
    before = engine_of(server).stats().generation_tokens_total
    with http.stream("POST", "/generate", json={"text": "abc", "sampling_params": LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine_of(server).stats().num_running == 1
        latencies = []
        for _ in range(5):  # the model computes on its thread; the HTTP layer answers meanwhile
            start = time.perf_counter()
            assert httpx.get(server.url + "/health").status_code == 200
            latencies.append(time.perf_counter() - start)
        assert engine_of(server).stats().num_running == 1
    wait_until_idle(server)
    stats = engine_of(server).stats()
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0
    assert stats.generation_tokens_total - before < LONG["max_new_tokens"]  # it was cut short
    assert max(latencies) < 0.5, latencies


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("prompt", ["abc", "ab" * 200])  # the long one: the choices share a prefill
def test_leaving_a_request_of_several_choices_aborts_them_all(server, stream, prompt):
    # 4 engine slots: choices 0..3 start, 4 and 5 wait for a slot.
    before = engine_of(server).stats().generation_tokens_total
    body = {"model": MODEL, "prompt": prompt, "n": 6, "stream": stream, **LONG_OPENAI, "max_tokens": 1000 - len(prompt)}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")  # before the running choices finish
            assert engine_of(server).stats().num_running == 4
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    wait_until_idle(server)
    stats = engine_of(server).stats()
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0
    assert stats.generation_tokens_total - before < 4 * LONG["max_new_tokens"]


def test_choices_refused_by_the_engine_compute_no_shared_prefill(server):
    before = engine_of(server).stats().prompt_tokens_total
    body = {"model": MODEL, "prompt": "ab" * 200, "n": 3, "max_tokens": 900}  # 400 + 900 tokens > the context
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    assert engine_of(server).stats().prompt_tokens_total == before


def _metric(http, name: str) -> float:
    return metric_value(http.get("/metrics").text, name, model_name=MODEL)


def test_a_shared_prefill_is_no_clients_request(http, server):
    """The n choices' shared prefill is internal: outside the latency metrics and token counts,
    and its captured state is not kept once the choices are done."""
    counts = ("engram:e2e_request_latency_seconds_count", "engram:time_to_first_token_seconds_count")
    wait_until_idle(server)
    before, stats = [_metric(http, name) for name in counts], engine_of(server).stats()
    body = {"model": MODEL, "prompt": "ba" * 200, "n": 3, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    wait_until_idle(server)
    after = engine_of(server).stats()
    assert [_metric(http, name) - b for name, b in zip(counts, before)] == [3, 3]
    assert after.generation_tokens_total - stats.generation_tokens_total == 3 * 4
    assert after.prompt_tokens_total - stats.prompt_tokens_total == 3 * usage["prompt_tokens"]
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is SequenceState]


def test_non_streaming_disconnect_aborts(server):
    before = engine_of(server).stats().generation_tokens_total
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json={"text": "abc", "sampling_params": LONG}, timeout=0.5)
    wait_until_idle(server)
    assert engine_of(server).stats().state_slots_used == 0
    assert engine_of(server).stats().generation_tokens_total - before < LONG["max_new_tokens"]


def test_concurrent_requests(http, server):
    bodies = [{"text": f"prompt {i}", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}} for i in range(6)]
    alone = [http.post("/generate", json=b).json()["text"] for b in bodies]
    results: list = [None] * len(bodies)

    def send(i: int) -> None:
        results[i] = httpx.post(server.url + "/generate", json=bodies[i], timeout=60).json()["text"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone  # batching (6 requests, 4 slots) does not change greedy outputs
    wait_until_idle(server)
