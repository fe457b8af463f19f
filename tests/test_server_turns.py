"""Exactly-once conversation turns over HTTP: an idempotency key answers a retry with the turn it
made (across a restart too), `expected_turn` refuses a turn appended to another history, and
responses carry the server's epoch."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
from server_utils import running_server

MODEL = "m"


@contextlib.contextmanager
def serving(path, snapshot_dir, **fields):
    with running_server(path, MODEL, snapshot_dir=str(snapshot_dir), **fields) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        yield srv, http


def turn(http, conversation_id, text, key=None, expect=200, **fields):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "conversation_id": conversation_id,
        "temperature": 0,
        "max_tokens": 8,
        **fields,
    }
    r = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": key} if key else {})
    assert r.status_code == expect, r.text
    return r.json()


def answer(response):
    return response["turn"], response["choices"][0]["message"]["content"], response["usage"]


def latest(http, conversation_id):
    return http.get(f"/v1/conversations/{conversation_id}").json()["branches"]["main"]["latest_turn"]


def streamed_text(http, body, key):
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers={"Idempotency-Key": key}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return events[0]["turn"], "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])


def test_a_retried_turn_is_answered_once_also_after_a_restart(checkpoint_dir, tmp_path):
    path = checkpoint_dir("nemotron")
    with serving(path, tmp_path) as (_, http):
        turn(http, "c", "first")
        first = turn(http, "c", "second", key="k-2")
        assert first["turn"] == 2
        assert answer(turn(http, "c", "second", key="k-2")) == answer(first)  # the retry: the same answer, no new turn
        assert answer(turn(http, "c", "second", turn_id="k-2")) == answer(first)  # the key as a body field
        body = {"model": MODEL, "messages": [{"role": "user", "content": "second"}], "conversation_id": "c", "max_tokens": 8}
        assert streamed_text(http, body, "k-2") == answer(first)[:2]
        assert latest(http, "c") == 2
        epoch = first["epoch"]
        assert http.get("/get_server_info").json()["epoch"] == epoch

        reused = turn(http, "c", "something else", key="k-2", expect=422)
        assert reused["error"]["param"] == "Idempotency-Key" and "other messages" in reused["error"]["message"]
        assert turn(http, "c", "x", key="k-3", turn_id="k-4", expect=400)["error"]["param"] == "turn_id"
        assert turn(http, "c", "x", key="a b", expect=400)["error"]["param"] == "Idempotency-Key"
        assert turn(http, "c", "x", turn_id="a b", expect=400)["error"]["param"] == "turn_id"  # the body form, the same rule
        r = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, headers={"Idempotency-Key": "k-5"}
        )
        assert r.status_code == 400 and "conversation_id" in r.json()["error"]["message"]
        assert latest(http, "c") == 2

    with serving(path, tmp_path) as (_, http):  # the key and the answer were recorded with the turn
        again = turn(http, "c", "second", key="k-2")
        assert answer(again) == answer(first) and again["epoch"] != epoch
        assert latest(http, "c") == 2
        assert turn(http, "c", "third", key="k-3")["turn"] == 3


def test_a_retry_while_the_turn_is_in_flight_gets_409_then_its_answer(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        made = {}
        worker = threading.Thread(target=lambda: made.update(turn(http, "busy", "long", key="k", max_tokens=600, ignore_eos=True)))
        worker.start()
        try:
            for _ in range(200):
                if srv.app.state.serving.engine.stats().num_running:
                    break
                time.sleep(0.01)
            busy = turn(http, "busy", "long", key="k", expect=409)
            assert "still in flight" in busy["error"]["message"]
        finally:
            worker.join()
        assert answer(turn(http, "busy", "long", key="k", max_tokens=600, ignore_eos=True)) == answer(made)
        assert latest(http, "busy") == 1


def test_expected_turn_refuses_a_turn_on_another_history(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path) as (_, http):
        assert turn(http, "e", "one", expected_turn=0)["turn"] == 1
        stale = turn(http, "e", "one again", expected_turn=0, expect=409)["error"]
        assert (stale["code"], stale["current_turn"]) == ("turn_mismatch", 1)
        assert turn(http, "e", "two", expected_turn=1)["turn"] == 2
        assert turn(http, "e", "other", branch="alt", from_turn=1, expected_turn=0)["turn"] == 2  # a new branch has none
        assert latest(http, "e") == 2
        assert turn(http, "e", "x", expected_turn=-1, expect=400)["error"]["param"] == "expected_turn"
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "expected_turn": 1})
        assert r.status_code == 400 and "need a conversation_id" in r.json()["error"]["message"]


def tokens_of(http, messages, add_generation_prompt):
    r = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": add_generation_prompt})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def fill_ids(http, conversation_id, turn_number):
    info = http.post("/get_snapshot_info", json={"conversation_id": conversation_id, "turn_number": turn_number}).json()
    return info["fill_ids"], info["state_len"]


def test_max_tokens_0_appends_without_generating_and_the_next_turn_continues_exactly(checkpoint_dir, tmp_path):
    doc = {"role": "user", "content": "A document to read: state space models keep a fixed-size state."}
    question = {"role": "user", "content": "What do they keep?"}
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        appended = turn(http, "d", doc["content"], max_tokens=0)
        assert (appended["turn"], appended["choices"][0]["message"]["content"]) == (1, "")
        assert (appended["choices"][0]["finish_reason"], appended["usage"]["completion_tokens"]) == ("length", 0)
        fill1, state_len1 = fill_ids(http, "d", 1)
        assert fill1 == tokens_of(http, [doc], False) and state_len1 == len(fill1)  # its state covers every token
        prefill = http.post("/generate", json={"input_ids": fill1, "sampling_params": {"max_new_tokens": 0}}).json()
        assert (prefill["output_ids"], prefill["meta_info"]["finish_reason"]["type"]) == ([], "length")  # SGLang's prefill only

        before = srv.app.state.serving.engine.stats().prefill_tokens_computed_total
        second = turn(http, "d", question["content"])
        computed = srv.app.state.serving.engine.stats().prefill_tokens_computed_total - before
        fill2, _ = fill_ids(http, "d", 2)
        prompt2 = fill2[: len(fill2) - second["usage"]["completion_tokens"]]
        assert prompt2 == tokens_of(http, [doc, question], True)  # as if the whole conversation were sent at once
        assert computed == len(prompt2) - len(fill1) and second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(fill1)
        full = http.post("/generate", json={"input_ids": prompt2, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}).json()
        assert full["output_ids"] == fill2[len(prompt2) :]

        # appended after a reply: the reply is closed as the template closes it, then the messages follow
        turn(http, "d", "Another document.", max_tokens=0)
        fill3, state_len3 = fill_ids(http, "d", 3)
        assert fill3[: len(fill2)] == fill2 and state_len3 == len(fill3)
        fourth = turn(http, "d", "Summarize.")
        fill4, _ = fill_ids(http, "d", 4)
        prompt4 = fill4[: len(fill4) - fourth["usage"]["completion_tokens"]]
        assert prompt4[: len(fill3)] == fill3
        full = http.post("/generate", json={"input_ids": prompt4, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}).json()
        assert full["output_ids"] == fill4[len(prompt4) :]
        roles = [m["role"] for m in http.get("/v1/conversations/d").json()["branches"]["main"]["messages"]]
        assert roles == ["user", "user", "assistant", "user", "user", "assistant"]


def test_a_request_that_resends_the_history_adds_only_its_new_messages(checkpoint_dir, tmp_path):
    def send(conversation_id, messages, key=None, expect=200):
        body = {"model": MODEL, "messages": messages, "conversation_id": conversation_id, "temperature": 0, "max_tokens": 8}
        r = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": key} if key else {})
        assert r.status_code == expect, r.text
        return r.json()

    a, b = {"role": "user", "content": "Hello"}, {"role": "user", "content": "And then?"}
    with serving(checkpoint_dir("nemotron"), tmp_path) as (_, http):
        r1 = {"role": "assistant", "content": send("h", [a])["choices"][0]["message"]["content"]}
        second = send("h", [a, r1, b], key="k")  # the whole conversation, as OpenAI clients send it
        assert answer(send("h", [a, r1, b], key="k")) == answer(second)  # its retry
        send("only-new", [a])
        assert answer(send("only-new", [b])) == answer(second)  # the same turn as sending only the new message
        assert fill_ids(http, "h", 2) == fill_ids(http, "only-new", 2)
        r2 = {"role": "assistant", "content": second["choices"][0]["message"]["content"]}
        stored = http.get("/v1/conversations/h").json()["branches"]["main"]["messages"]
        assert stored == [a, r1, b, r2]

        edited = send("h", [a, {"role": "assistant", "content": r1["content"] + "!"}, b], expect=400)["error"]
        assert edited["param"] == "messages" and "message 1 differs" in edited["message"]
        assert "add nothing" in send("h", [a, r1, b, r2], expect=400)["error"]["message"]
        assert "add nothing" in send("h", [a, r1], expect=400)["error"]["message"]
        assert send("h", [a])["turn"] == 3  # one message is always new, even one the history holds


def test_the_client_retries_a_turn_whose_answer_was_lost_and_it_is_made_once(checkpoint_dir, tmp_path):
    from engram.client import EngramClient

    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        client = EngramClient(srv.url)
        send = client.http.request
        lost = []

        def lose_the_first_answer(method, path, **kw):
            response = send(method, path, **kw)
            if path == "/v1/chat/completions" and not lost:
                lost.append(response)
                raise httpx.ReadTimeout("the answer was lost")
            return response

        client.http.request = lose_the_first_answer
        conv = client.conversation("lost", temperature=0, max_tokens=6, retry_wait=0)
        text = conv.chat("hello")
        assert lost and text == lost[0].json()["choices"][0]["message"]["content"]
        assert conv.turn == 1 and latest(http, "lost") == 1
        assert conv.epoch == http.get("/get_server_info").json()["epoch"]
