"""Every request field vLLM or SGLang users send is honoured or refused with a 400 that names it
(issue 33: "no silent ignores"). The table sends each field; an honoured one must show its effect
against the same request without it, so a field that is accepted and ignored fails here."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from server_utils import openai_client, running_server

from engram.models.embedded import ensure_embedded_model

MODEL = "tiny-hybrid"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
MESSAGES = [{"role": "user", "content": "Hello there"}]
BASE: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0},
    COMPLETIONS: {"model": MODEL, "prompt": "Once upon", "max_tokens": 8, "temperature": 0},
    GENERATE: {"text": "Once upon", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return ensure_embedded_model(tmp_path_factory.getbasetemp() / "engram-cache")


@pytest.fixture(scope="module")
def server(model_path):
    with running_server(model_path, MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def post(http: httpx.Client, route: str, **fields: Any) -> httpx.Response:
    body = {**BASE[route], **fields}
    if route == GENERATE and "sampling_params" in fields:
        body["sampling_params"] = {**BASE[GENERATE]["sampling_params"], **fields["sampling_params"]}
    return http.post(route, json=body)


def ok(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def text_of(route: str, body: Any) -> str:
    if route == CHAT:
        return body["choices"][0]["message"]["content"]
    return body["choices"][0]["text"] if route == COMPLETIONS else body["text"]


def baseline(http: httpx.Client, route: str) -> Any:
    return ok(post(http, route))


# ---- refused: (route, field, value) -------------------------------------------------------------

REFUSED = [
    (CHAT, "chat_template", "{{ messages }}"),
    (CHAT, "echo", True),
    (CHAT, "add_special_tokens", True),
    (CHAT, "documents", [{"title": "t", "text": "x"}]),
    (CHAT, "prompt_logprobs", 1, {"stream": True}),
    (COMPLETIONS, "suffix", "end"),
    (COMPLETIONS, "conversation_id", "c1"),
    (GENERATE, "conversation_id", "c1"),
    (GENERATE, "lora_path", "adapter"),
    (GENERATE, "lora_id", "adapter"),
    (GENERATE, "custom_logit_processor", "{}"),
    (GENERATE, "input_embeds", [[0.0]]),
    (GENERATE, "image_data", "x.png"),
    (GENERATE, "session_params", {"id": "s"}),
    (GENERATE, "return_hidden_states", True),
    (GENERATE, "logprob_start_len", 0),
    (GENERATE, "token_ids_logprob", [1]),
    (GENERATE, "no_such_field", 1),
    (GENERATE, "max_tokens", 4),  # the OpenAI name at the top level of /generate
]
for _route in (CHAT, COMPLETIONS):
    REFUSED += [
        (_route, name, value)
        for name, value in (
            ("use_beam_search", True),
            ("best_of", 3),
            ("length_penalty", 2.0),
            ("truncate_prompt_tokens", 4),
            ("spaces_between_special_tokens", False),
            ("logits_processors", ["x"]),
            ("return_tokens_as_token_ids", True),
            ("return_token_ids", True),
            ("priority", 1),
            ("cache_salt", "s"),
            ("kv_transfer_params", {"a": 1}),
            ("vllm_xargs", {"a": 1}),
            ("mm_processor_kwargs", {"a": 1}),
        )
    ]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: f"{c[0]}:{c[1]}")
def test_refused_fields_are_400_naming_them(http, case):
    route, name, value, *rest = case
    r = post(http, route, **{name: value}, **(rest[0] if rest else {}))
    assert r.status_code == 400, r.text
    assert name in r.json()["error"]["message"]


# ---- honoured: (route, field, fields, check(response, baseline, http)) ---------------------------


def _model_optional(route: str) -> Callable[..., None]:
    def check(http: httpx.Client) -> None:
        body = {k: v for k, v in BASE[route].items() if k != "model"}
        got = ok(http.post(route, json=body))
        assert got["model"] == MODEL and text_of(route, got) == text_of(route, baseline(http, route))

    return check


def _request_id(route: str, prefix: str) -> Callable[..., None]:
    def check(http: httpx.Client) -> None:
        assert ok(post(http, route, request_id="mine-1"))["id"] == f"{prefix}-mine-1"

    return check


def _min_tokens(route: str) -> Callable[..., None]:
    """A stop token that ends the greedy output at once is held back until min_tokens."""

    def check(http: httpx.Client) -> None:
        stop_id = _first_token(http, route)
        if route == GENERATE:
            stopped = ok(post(http, route, sampling_params={"stop_token_ids": [stop_id]}))
            held = ok(post(http, route, sampling_params={"stop_token_ids": [stop_id], "min_new_tokens": 5}))
            assert stopped["meta_info"]["completion_tokens"] == 1 and held["meta_info"]["completion_tokens"] >= 5
            return
        stopped = ok(post(http, route, stop_token_ids=[stop_id]))
        held = ok(post(http, route, stop_token_ids=[stop_id], min_tokens=5))
        assert stopped["usage"]["completion_tokens"] == 1 and held["usage"]["completion_tokens"] >= 5

    return check


def _first_token(http: httpx.Client, route: str) -> int:
    """The greedy first token of the route's base request."""
    if route == CHAT:
        prompt = ok(http.post("/tokenize", json={"messages": MESSAGES}))["tokens"]
    else:
        prompt = list(BASE[COMPLETIONS]["prompt"].encode())
    return ok(http.post(GENERATE, json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}))["output_ids"][0]


def _allowed_token_ids(route: str) -> Callable[..., None]:
    def check(http: httpx.Client) -> None:
        got = text_of(route, ok(post(http, route, allowed_token_ids=[ord("a"), ord("b")], ignore_eos=True)))
        assert got and set(got) <= {"a", "b"}

    return check


def _bad_words(route: str) -> Callable[..., None]:
    def check(http: httpx.Client) -> None:
        free = text_of(route, ok(post(http, route, max_tokens=24)))
        word = next(c for c in free if c.isascii() and c.isalnum())
        got = text_of(route, ok(post(http, route, max_tokens=24, bad_words=[word])))
        assert word not in got and got != free

    return check


def _user(route: str) -> Callable[..., None]:
    """OpenAI's end-user tag: vLLM takes it and does nothing with it; so does this server."""

    def check(http: httpx.Client) -> None:
        assert text_of(route, ok(post(http, route, user="u1"))) == text_of(route, baseline(http, route))

    return check


def _chat_prompt_logprobs(http: httpx.Client) -> None:
    body = ok(post(http, CHAT, prompt_logprobs=2))
    got = body["prompt_logprobs"]
    assert len(got) == body["usage"]["prompt_tokens"] and got[0] is None
    assert all(2 <= len(entry) <= 3 for entry in got[1:])
    assert "prompt_logprobs" not in baseline(http, CHAT)


def _echo(http: httpx.Client) -> None:
    got = ok(post(http, COMPLETIONS, echo=True))["choices"][0]["text"]
    assert got == BASE[COMPLETIONS]["prompt"] + text_of(COMPLETIONS, baseline(http, COMPLETIONS))


def _batched_prompts(http: httpx.Client) -> None:
    prompts = ["Once upon", "A time"]
    singles = [text_of(COMPLETIONS, ok(post(http, COMPLETIONS, prompt=p))) for p in prompts]
    body = ok(post(http, COMPLETIONS, prompt=prompts, n=2))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [singles[0], singles[0], singles[1], singles[1]]
    ids = ok(post(http, COMPLETIONS, prompt=[list(p.encode()) for p in prompts]))
    assert [c["text"] for c in ids["choices"]] == singles
    assert ids["usage"]["prompt_tokens"] == sum(map(len, prompts))


def _generate_batch(http: httpx.Client) -> None:
    texts = ["Once upon", "A time"]
    singles = [ok(post(http, GENERATE, text=t))["text"] for t in texts]
    assert [r["text"] for r in ok(post(http, GENERATE, text=texts))] == singles
    assert [r["text"] for r in ok(post(http, GENERATE, text=None, input_ids=[list(t.encode()) for t in texts]))] == singles
    results = ok(post(http, GENERATE, text=texts, sampling_params={"n": 2}, rid=["r1", "r2"]))
    assert [r["text"] for r in results] == [singles[0], singles[0], singles[1], singles[1]]
    assert [r["meta_info"]["id"] for r in results] == ["r1-0", "r1-1", "r2-0", "r2-1"]


def _generate_batch_streamed(http: httpx.Client) -> None:
    texts = ["Once upon", "A time"]
    singles = [ok(post(http, GENERATE, text=t, return_logprob=True)) for t in texts]
    body = {**BASE[GENERATE], "text": texts, "sampling_params": {**BASE[GENERATE]["sampling_params"], "n": 2}, "stream": True, "return_logprob": True}
    with http.stream("POST", GENERATE, json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    last = {e["index"]: e for e in events}  # cumulative: the last event of each holds its whole result
    assert sorted(last) == [0, 1, 2, 3] and len(events) > 4
    for i, single in zip(range(4), [singles[0], singles[0], singles[1], singles[1]]):
        assert last[i]["text"] == single["text"] and last[i]["meta_info"]["finish_reason"] is not None
        assert [lp[1] for lp in last[i]["meta_info"]["output_token_logprobs"]] == single["output_ids"]


def _generate_n(http: httpx.Client) -> None:
    results = ok(post(http, GENERATE, sampling_params={"n": 3, "temperature": 1.0, "sampling_seed": 5}))
    assert isinstance(results, list) and len(results) == 3
    assert len({r["text"] for r in results}) > 1  # three draws, not one answer thrice


def _return_text_in_logprobs(http: httpx.Client) -> None:
    plain = ok(post(http, GENERATE, return_logprob=True, top_logprobs_num=2))["meta_info"]
    body = ok(post(http, GENERATE, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True))
    entries = body["meta_info"]["output_token_logprobs"]
    assert all(text is None for _, _, text in plain["output_token_logprobs"])
    assert entries and all(text == ok(http.post("/detokenize", json={"tokens": [t]}))["prompt"] for _, t, text in entries)
    assert all(isinstance(text, str) for top in body["meta_info"]["output_top_logprobs"] for _, _, text in top)


HONOURED: list[tuple[str, Callable[[httpx.Client], None]]] = [
    ("chat:model omitted", _model_optional(CHAT)),
    ("completions:model omitted", _model_optional(COMPLETIONS)),
    ("chat:request_id", _request_id(CHAT, "chatcmpl")),
    ("completions:request_id", _request_id(COMPLETIONS, "cmpl")),
    ("chat:min_tokens", _min_tokens(CHAT)),
    ("completions:min_tokens", _min_tokens(COMPLETIONS)),
    ("generate:min_new_tokens", _min_tokens(GENERATE)),
    ("chat:allowed_token_ids", _allowed_token_ids(CHAT)),
    ("completions:allowed_token_ids", _allowed_token_ids(COMPLETIONS)),
    ("chat:bad_words", _bad_words(CHAT)),
    ("completions:bad_words", _bad_words(COMPLETIONS)),
    ("chat:user", _user(CHAT)),
    ("chat:prompt_logprobs", _chat_prompt_logprobs),
    ("completions:echo", _echo),
    ("completions:batched prompts", _batched_prompts),
    ("generate:batched text and input_ids", _generate_batch),
    ("generate:batch streamed", _generate_batch_streamed),
    ("generate:sampling_params.n", _generate_n),
    ("generate:return_text_in_logprobs", _return_text_in_logprobs),
]


@pytest.mark.parametrize("check", [c for _, c in HONOURED], ids=[name for name, _ in HONOURED])
def test_honoured_fields_have_their_effect(http, check):
    check(http)


# ---- exactness against transformers --------------------------------------------------------------


def hf_logprobs(hf_model, path, prompt_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(str(path))(torch.tensor([prompt_ids])).logits[0].float(), -1)


def test_echo_with_logprobs_gives_the_prompt_logprobs_of_transformers(http, model_path, hf_model):
    prompt = "Once upon a time"
    body = ok(post(http, COMPLETIONS, prompt=prompt, echo=True, logprobs=2, max_tokens=3))
    choice = body["choices"][0]
    ids = list(prompt.encode())
    lp = choice["logprobs"]
    assert lp["tokens"][: len(ids)] == list(prompt) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(ids) + 3 and lp["text_offset"][: len(ids)] == list(range(len(ids)))
    ref = hf_logprobs(hf_model, model_path, ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
        top = ref[i - 1].topk(2).values.tolist()  # keyed by token text: two tokens of one text (a lone byte) share an entry
        assert lp["top_logprobs"][i] and all(min(abs(v - t) for t in top) < 1e-4 for v in lp["top_logprobs"][i].values())
    assert choice["prompt_logprobs"][1][str(ids[1])]["logprob"] == pytest.approx(lp["token_logprobs"][1])
    only_prompt = ok(post(http, COMPLETIONS, prompt=prompt, echo=True, logprobs=0, max_tokens=0))["choices"][0]
    assert only_prompt["text"] == prompt and only_prompt["logprobs"]["token_logprobs"][1:] == lp["token_logprobs"][1 : len(ids)]


def test_echo_streams_the_prompt_first(http):
    with http.stream("POST", COMPLETIONS, json={**BASE[COMPLETIONS], "echo": True, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    texts = [json.loads(e)["choices"][0]["text"] for e in events if json.loads(e)["choices"]]
    assert texts[0].startswith(BASE[COMPLETIONS]["prompt"])
    assert "".join(texts) == ok(post(http, COMPLETIONS, echo=True))["choices"][0]["text"]


def test_chat_prompt_logprobs_match_transformers(http, server, model_path, hf_model):
    body = ok(post(http, CHAT, prompt_logprobs=1, max_tokens=1))
    tokenizer = server.app.state.serving.tokenizer
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    ref = hf_logprobs(hf_model, model_path, ids)
    got = body["prompt_logprobs"]
    assert len(got) == len(ids)
    for i in range(1, len(ids)):
        entry = got[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
        assert entry["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        best = int(ref[i - 1].argmax())
        assert got[i][str(best)]["rank"] == 1


def test_embeddings_are_the_mean_last_hidden_state_of_transformers(http, server, model_path, hf_model):
    texts = ["Once upon a time", "Hi"]
    body = ok(http.post("/v1/embeddings", json={"model": MODEL, "input": texts}))
    assert body["object"] == "list" and body["model"] == MODEL
    assert body["usage"] == {"prompt_tokens": sum(map(len, texts)), "total_tokens": sum(map(len, texts))}
    for item, text in zip(body["data"], texts):
        with torch.no_grad():
            out = hf_model(str(model_path))(torch.tensor([list(text.encode())]), output_hidden_states=True)
        ref = out.hidden_states[-1][0].float().mean(0)
        torch.testing.assert_close(torch.tensor(item["embedding"]), ref, atol=1e-4, rtol=1e-4)
    encoded = ok(http.post("/v1/embeddings", json={"input": [list(texts[0].encode())], "encoding_format": "base64"}))
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(body["data"][0]["embedding"], abs=1e-6)
    sdk = openai_client(server.url).embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64 and decodes it
    assert [d.embedding for d in sdk.data] == [pytest.approx(d["embedding"], abs=1e-6) for d in body["data"]]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input": "a", "dimensions": 7}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "model": "other"}, "model"),
        ({"input": []}, "empty"),
        ({"input": ""}, "empty"),
        ({"input": "a", "conversation_id": "c"}, "conversation_id"),
    ],
)
def test_bad_embedding_requests(http, body, says):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == (404 if says == "model" else 400), r.text
    assert says in r.text


def test_prompt_logprobs_compute_a_prompt_the_prefix_cache_holds(model_path, tmp_path):
    """A prompt whose prefix is cached is still computed whole for its prompt logprobs (the cache
    would leave its first positions without logits)."""
    with running_server(model_path, MODEL, snapshot_dir=str(tmp_path), enable_prefix_caching=True, prefix_cache_min_tokens=1) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            first = ok(post(client, COMPLETIONS, prompt="Once upon a time"))
            again = ok(post(client, COMPLETIONS, prompt="Once upon a time, there", prompt_logprobs=0))
            plain = ok(post(client, COMPLETIONS, prompt="Once upon a time, there"))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache holds that prefix
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(again["choices"][0]["prompt_logprobs"]) == again["usage"]["prompt_tokens"]
