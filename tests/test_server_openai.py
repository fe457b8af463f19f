"""The OpenAI-compatible routes, driven over real HTTP by the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import openai_client, running_server

from engram.models.embedded import ensure_embedded_model

MODEL = "tiny-hybrid"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(ensure_embedded_model(tmp_path_factory.getbasetemp() / "engram-cache"), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.app.state.serving.tokenizer


def chat_prompt_len(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == server.app.state.serving.engine.engine.max_context_length


def test_chat(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == chat_prompt_len(tokenizer, MESSAGES)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    newer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert newer.usage.completion_tokens == 3


def test_chat_greedy_is_deterministic_and_streaming_matches(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    first = client.chat.completions.create(**kw)
    second = client.chat.completions.create(**kw)
    assert first.choices[0].message.content == second.choices[0].message.content

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [first.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == first.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])  # greedy picks the best token
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, stream=True, logprobs=True, extra_body={"ignore_eos": True}
    )
    streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-5)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_stop_string_and_seed(client):
    kw = dict(model=MODEL, prompt="The cat", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[8:10]
    assert stop and full.index(stop) >= 1
    stopped = client.completions.create(**kw, stop=[stop]).choices[0]
    assert stopped.text == full[: full.index(stop)] and stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == stop  # vLLM's field: which stop ended it
    assert client.completions.create(**kw).choices[0].model_extra["stop_reason"] is None  # ended by length
    # Streamed, the start of a stop string that spans two tokens is held back until the rest shows.
    tokens = client.completions.create(**kw, logprobs=1).choices[0].logprobs.tokens
    at = [len("".join(tokens[: i + 1])) for i in range(len(tokens) - 1) if tokens[i] and tokens[i + 1]]
    cut = next(c for c in at if full.index(full[c - 1 : c + 1]) == c - 1)
    spanning = full[cut - 1 : cut + 1]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=[spanning], stream=True))
    assert streamed == full[: cut - 1]

    sampled = [client.completions.create(model=MODEL, prompt="The cat", max_tokens=16, temperature=1.0, seed=7).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_stop_token_and_eos_text_are_left_out_unless_include_stop_str_in_output(client, server, tokenizer):
    """As vLLM: the text of the stop token (or EOS, whatever skip_special_tokens says) that ended a
    reply is left out, and kept with include_stop_str_in_output, as is a stop string; the token
    ids are the same either way."""
    kw = {"model": MODEL, "prompt": "The cat", "temperature": 0}
    eos_free = {"ignore_eos": True}
    ids = httpx.post(
        server.url + "/generate", json={"text": "The cat", "sampling_params": {"max_new_tokens": 24, "temperature": 0, **eos_free}}
    ).json()["output_ids"]
    i = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and chr(ids[i]).isascii() and chr(ids[i]).isalnum())  # a letter, first here
    before, through = (client.completions.create(**kw, max_tokens=n, extra_body=eos_free).choices[0].text for n in (i, i + 1))
    assert through != before
    by_token = {**eos_free, "stop_token_ids": [ids[i]]}
    left_out = client.completions.create(**kw, max_tokens=24, extra_body=by_token).choices[0]
    assert left_out.text == before and left_out.model_extra["stop_reason"] == ids[i] and left_out.finish_reason == "stop"
    kept = client.completions.create(**kw, max_tokens=24, extra_body={**by_token, "include_stop_str_in_output": True}).choices[0]
    assert kept.text == through and kept.model_extra["stop_reason"] == ids[i]
    streamed = client.completions.create(**kw, max_tokens=24, extra_body=by_token, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == before

    full = client.completions.create(**kw, max_tokens=24, extra_body=eos_free).choices[0].text
    stop = full[8:10]
    for stream in (False, True):
        made = client.completions.create(**kw, max_tokens=24, stop=[stop], stream=stream, extra_body={**eos_free, "include_stop_str_in_output": True})
        text = "".join(c.choices[0].text for c in made) if stream else made.choices[0].text
        assert text == full[: full.index(stop) + len(stop)]

    eos = {str(tokenizer.eos_token_id): 100}
    for fields, text in (
        ({"skip_special_tokens": False}, ""),
        ({"skip_special_tokens": False, "include_stop_str_in_output": True}, tokenizer.eos_token),
    ):
        forced = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, logit_bias=eos, extra_body=fields)
        assert forced.choices[0].message.content == text and forced.choices[0].finish_reason == "stop"
    native = {"text": "The cat", "sampling_params": {"max_new_tokens": 24, "temperature": 0, "stop_token_ids": [ids[i]], **eos_free}}
    assert httpx.post(server.url + "/generate", json=native).json()["text"] == before
    native["sampling_params"]["no_stop_trim"] = True  # SGLang's name for it
    out = httpx.post(server.url + "/generate", json=native).json()
    assert out["text"] == through and out["output_ids"] == ids[: i + 1]


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 8 and r.usage.total_tokens == 11
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 8
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0

    stream = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == 8


def test_completion_with_token_ids(client):
    by_text = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=list(b"abc"), max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_logit_bias_forces_a_token_and_ignored_tools_are_allowed(client, tokenizer):
    (z,) = tokenizer.encode("z", add_special_tokens=False)
    kw = dict(model=MODEL, prompt="abc", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text != "z" * 6
    assert client.completions.create(logit_bias={str(z): 100}, **kw).choices[0].text == "z" * 6
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, tools=tools, tool_choice="none", response_format={"type": "text"}
    )
    assert r.choices[0].finish_reason in ("stop", "length")


def test_n_choices_are_separate_requests_of_one_prompt(client):
    kw = dict(model=MODEL, prompt="abc", max_tokens=5, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, n=3, **kw)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.prompt_tokens == 3 and greedy.usage.completion_tokens == 15
    seeded = client.completions.create(temperature=1.0, n=2, seed=7, **kw)
    for i, seed in enumerate((7, 8)):  # choice i draws with seed + i
        assert seeded.choices[i].text == client.completions.create(temperature=1.0, seed=seed, **kw).choices[0].text

    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(n=2, **chat)
    texts, finished = {0: "", 1: ""}, set()
    stream = client.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **chat)
    for c in stream:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == {i: whole.choices[i].message.content for i in (0, 1)} and finished == {0, 1}
    assert c.usage.completion_tokens == 12 == whole.usage.completion_tokens


def test_n_choices_of_a_long_prompt_share_its_prefill_exactly(client):
    kw = dict(model=MODEL, prompt="ab" * 200, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alone = client.completions.create(**kw)
    shared = client.completions.create(n=3, **kw)
    assert alone.usage.prompt_tokens >= 256 and alone.usage.prompt_tokens_details.cached_tokens == 0
    assert [c.text for c in shared.choices] == [alone.choices[0].text] * 3
    assert shared.usage.prompt_tokens_details.cached_tokens == 0  # computed in this request, once


def test_tokenize_and_detokenize(client, server, tokenizer):
    post = lambda route, body: httpx.post(server.url + route, json=body)  # noqa: E731
    r = post("/tokenize", {"model": MODEL, "prompt": "abc def"}).json()
    completion = client.completions.create(model=MODEL, prompt="abc def", max_tokens=1)
    assert r["count"] == len(r["tokens"]) == completion.usage.prompt_tokens and r["max_model_len"] == 1024
    assert post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "abc def"}
    chat = post("/tokenize", {"messages": MESSAGES}).json()
    assert chat["count"] == chat_prompt_len(tokenizer, MESSAGES)
    assert post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["count"] < chat["count"]
    # the template options of a chat request, with the same prompt as that request
    partial = MESSAGES + [{"role": "assistant", "content": "Sure"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    continued = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=1, extra_body=options).usage.prompt_tokens
    assert post("/tokenize", {"messages": partial, **options}).json()["count"] == continued
    assert continued < post("/tokenize", {"messages": partial, "add_generation_prompt": False}).json()["count"]
    for route, body, status, says in (
        ("/detokenize", {"tokens": [99999]}, 400, "outside the vocabulary"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "exactly one"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "add_generation_prompt=false"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, 400, "may not set tools"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "does not exist"),
    ):
        bad = post(route, body)
        assert bad.status_code == status and says in bad.json()["error"]["message"], bad.text


def test_chat_template_options_and_no_op_values_of_unsupported_fields(client, tokenizer):
    """add_generation_prompt / continue_final_message reach the template (the prompt's token count
    shows it); vLLM's fields asked for nothing (min_tokens 0, best_of = n, echo false) are accepted."""
    kw = dict(model=MODEL, max_tokens=1)
    full = client.chat.completions.create(messages=MESSAGES, **kw).usage.prompt_tokens
    bare = client.chat.completions.create(messages=MESSAGES, extra_body={"add_generation_prompt": False}, **kw).usage.prompt_tokens
    assert full == chat_prompt_len(tokenizer, MESSAGES) and bare < full
    partial = MESSAGES + [{"role": "assistant", "content": "Sure"}]
    continued = client.chat.completions.create(
        messages=partial, extra_body={"add_generation_prompt": False, "continue_final_message": True}, **kw
    ).usage.prompt_tokens
    closed = client.chat.completions.create(messages=partial, extra_body={"add_generation_prompt": False}, **kw).usage.prompt_tokens
    assert continued < closed  # the assistant's turn left open: no end-of-message tokens after "Sure"
    forced_eos = client.chat.completions.create(messages=MESSAGES, logit_bias={str(tokenizer.eos_token_id): 100}, **kw).choices[0]
    assert forced_eos.finish_reason == "stop" and forced_eos.model_extra["stop_reason"] is None  # EOS: None, as vLLM
    no_ops = {"min_tokens": 0, "best_of": 1, "use_beam_search": False, "include_stop_str_in_output": False}
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=1, echo=False, extra_body=no_ops).usage.completion_tokens == 1


def test_client_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="less than or equal to 64"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=65)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        ("/v1/chat/completions", '{"model": "tiny-hybrid", "messages": [', "malformed JSON"),
        ("/v1/chat/completions", "[1, 2]", "valid dictionary"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "content"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "a"}]}, "role"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": "9"}, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, "empty"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, "vocabulary"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "stream": "yes"}, "stream"),
        ("/v1/completions", {"model": MODEL, "prompt": "a" * 1100, "max_tokens": 1}, "context length"),
        (
            "/v1/chat/completions",
            '{"model": "tiny-hybrid", "messages": [{"role": "user", "content": "a"}], "repetition_penalty": NaN}',
            "repetition_penalty",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "presence_penalty": -1e308}, "presence_penalty"),
        ("/v1/chat/completions", '{"model": "tiny-hybrid", "messages": [{"role": "user", "content": "\\ud800"}]}', "not valid Unicode"),
        ("/v1/completions", '{"model": "tiny-hybrid", "prompt": "\\udc00"}', "not valid Unicode"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "stop": [""]}, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": {"5": 200}}, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": {"99999": 1}}, "logit_bias token ids outside the vocabulary"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
        ("/generate", {"text": "a", "sampling_params": {"logit_bias": {"-1": 1}}}, "outside the vocabulary"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
            '"auto" tool choice needs a server started',
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "tool_choice": "required"},
            "tool_choice: a tool choice other than 'none' needs tools",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "functions": [{"name": "f"}], "function_call": "auto"},
            "--enable-auto-tool-choice",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "min_tokens": 4, "use_beam_search": True}, "use_beam_search: not supported"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "best_of": 3}, "best_of: not supported"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
            "continue_final_message needs add_generation_prompt=false",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "conversation_id": "c", "add_generation_prompt": False},
            "a conversation turn renders its own template",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "a"}],
                "chat_template_kwargs": {"tokenize": True, "chat_template": "{{ 1/0 }}"},
            },
            "chat_template_kwargs may not set chat_template, tokenize",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "conversation_id": "c", "n": 2},
            "n must be 1 with a conversation_id",
        ),
    ],
)
def test_bad_requests_are_4xx_with_a_message(server, route, body, says):
    kw = {"json": body} if isinstance(body, dict) else {"content": body, "headers": {"content-type": "application/json"}}
    r = httpx.post(server.url + route, **kw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"


def test_tiny_temperature_or_top_p_is_greedy_and_chat_has_no_default_token_limit(client, tokenizer, server):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=6, extra_body={"ignore_eos": True})
    greedy = client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    assert client.chat.completions.create(temperature=1e-46, **kw).choices[0].message.content == greedy
    assert client.chat.completions.create(top_p=1e-300, seed=3, **kw).choices[0].message.content == greedy
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    context = server.app.state.serving.engine.engine.max_context_length
    assert r.usage.completion_tokens == context - chat_prompt_len(tokenizer, MESSAGES) and r.choices[0].finish_reason == "length"


def test_unknown_route_is_json_404(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
