"""Exact persistent conversations over HTTP: continued by conversation_id across a server restart,
and through restore-and-generate, equal to one request over the whole history."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
from server_utils import running_server

from engram.client import EngramClient, SnapshotManager, SnapshotNotFoundError

MODEL = "m"
GREEDY = {"temperature": 0, "max_tokens": 10}
USER_TURNS = ["Hello there, how are you?", "Tell me about state space models.", "And what about attention?"]


@contextlib.contextmanager
def serving(path: str, snapshot_dir, **server_fields):
    with running_server(path, MODEL, snapshot_dir=str(snapshot_dir), **server_fields) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        yield srv, http


def chat(http, conversation_id, text, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "conversation_id": conversation_id, **GREEDY, **fields}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stats(srv):
    return srv.app.state.serving.engine.stats()


def snapshot_info(http, conversation_id, turn):
    r = http.post("/get_snapshot_info", json={"conversation_id": conversation_id, "turn_number": turn})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("kind", ["mamba2", "nemotron"])
def test_three_turns_across_a_restart_equal_one_request_over_the_history(kind, checkpoint_dir, tmp_path):
    path = checkpoint_dir(kind)
    with serving(path, tmp_path) as (srv, http):
        first = chat(http, "conv", USER_TURNS[0])
        second = chat(http, "conv", USER_TURNS[1])
        assert (first["turn"], second["turn"]) == (1, 2) and second["conversation_id"] == "conv"
        history = snapshot_info(http, "conv", 2)["fill_ids"]  # every token so far, the replies as generated

    with serving(path, tmp_path) as (srv, http):  # a new process's view: nothing in memory
        before = stats(srv).prefill_tokens_computed_total
        third = chat(http, "conv", USER_TURNS[2], logprobs=True, top_logprobs=5)
        computed = stats(srv).prefill_tokens_computed_total - before
        assert third["turn"] == 3
        fill3 = snapshot_info(http, "conv", 3)["fill_ids"]
        reply_len = third["usage"]["completion_tokens"]
        prompt3 = fill3[: len(fill3) - reply_len]
        assert prompt3[: len(history)] == history  # the conversation continues the exact tokens
        new_tokens = len(prompt3) - len(history)
        assert computed == new_tokens + 1  # only the new turn (and the reply's last token) was computed
        assert third["usage"]["prompt_tokens"] == len(prompt3)
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) - 1

        # one request over the whole history
        full = http.post("/generate", json={"input_ids": prompt3, "return_logprob": True, "top_logprobs_num": 5,
                                            "sampling_params": {"temperature": 0, "max_new_tokens": 10}}).json()
        assert full["output_ids"] == fill3[len(prompt3):]
        assert full["text"] == third["choices"][0]["message"]["content"]
        # the first new token's distribution: top-5 log-probabilities agree to 1e-4
        first_top = [t["logprob"] for t in third["choices"][0]["logprobs"]["content"][0]["top_logprobs"]]
        full_top = [logprob for logprob, _, _ in full["meta_info"]["output_top_logprobs"][0]]
        assert len(first_top) == len(full_top) == 5
        assert max(abs(a - b) for a, b in zip(first_top, full_top)) < 1e-4

        # the same through restore-and-generate from turn 2's snapshot
        continuation = prompt3[len(history):]
        r = http.post("/restore_snapshot", json={"conversation_id": "conv", "turn_number": 2, "create_new_request": True,
                                                 "continuation_ids": continuation, "max_new_tokens": 10,
                                                 "sampling_params": {"temperature": 0}})
        assert r.status_code == 200, r.text
        restored = r.json()
        assert restored["success"] and restored["output_ids"] == full["output_ids"]
        assert restored["meta_info"]["cached_tokens"] == len(history) - 1


def test_snapshot_routes_and_client(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path, snapshot_trigger_policy="manual_only") as (srv, http):
        client = EngramClient(srv.url)
        conv = client.conversation("c", temperature=0, max_tokens=6)
        conv.chat("one")
        conv.chat("two")
        snaps = SnapshotManager(client)
        assert snaps.list_conversation("c") == []  # manual_only: nothing saved yet
        saved = snaps.save("c")
        assert (saved["success"], saved["turn_number"]) == (True, 2)
        listed = snaps.list_conversation("c")
        assert [s["turn_number"] for s in listed] == [2]
        info = snaps.get_info("c")
        assert info["fill_ids"] == listed[0]["fill_ids"] and info["manifest"]["format"] == "engram-state/1"
        assert len(info["fill_ids"]) == info["token_count"] == info["state_len"] + 1

        # save by the rid of the request that made a turn
        rid = conv.last_response["id"]
        assert snaps.save(rid=rid)["turn_number"] == 2

        # restore-only stages the state for /generate with that rid: only the new tokens are computed
        staged = http.post("/restore_snapshot", json={"conversation_id": "c", "rid": "again"}).json()
        assert staged["success"] and staged["state_len"] == info["state_len"]
        before = stats(srv).prefill_tokens_computed_total
        r = http.post("/generate", json={"rid": "again", "input_ids": info["fill_ids"] + [65, 66],
                                         "sampling_params": {"temperature": 0, "max_new_tokens": 3}}).json()
        assert r["meta_info"]["cached_tokens"] == info["state_len"]
        assert stats(srv).prefill_tokens_computed_total - before == 3

        snaps.delete("c")
        assert snaps.list_conversation("c") == []
        with pytest.raises(SnapshotNotFoundError):
            snaps.get_info("c")

        got = client.get_conversation("c")
        assert got["branches"]["main"]["latest_turn"] == 2
        assert [m["role"] for m in got["branches"]["main"]["messages"]] == ["user", "assistant", "user", "assistant"]
        client.delete_conversation("c")
        assert http.get("/v1/conversations/c").status_code == 404


def test_branches_and_regeneration_over_http(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        chat(http, "b", "first")
        two = chat(http, "b", "second")
        alt = chat(http, "b", "other second", branch="alt", from_turn=1)
        assert (alt["branch"], alt["turn"]) == ("alt", 2)
        regen = chat(http, "b", "second", from_turn=1)
        assert regen["turn"] == 2
        assert regen["choices"][0]["message"]["content"] == two["choices"][0]["message"]["content"]  # greedy: same reply
        conv = http.get("/v1/conversations/b").json()
        assert sorted(conv["branches"]) == ["alt", "main"]


def test_honest_status_codes(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        def post(path, body):
            r = http.post(path, json=body)
            return r.status_code, r.json()

        assert post("/get_snapshot_info", {"conversation_id": "nope"})[0] == 404
        code, body = post("/get_snapshot_info", {"conversation_id": "../etc"})
        assert code == 422 and body["success"] is False and "invalid conversation_id" in body["error"]["message"]
        assert post("/get_snapshot_info", {"conversation_id": 5})[0] == 422
        assert post("/get_snapshot_info", {"conversation_id": "x", "snapshot_id": "main/abc"})[0] == 422
        assert post("/save_snapshot", {})[0] == 422
        assert post("/save_snapshot", {"rid": "unknown"})[0] == 404
        code, body = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                   "conversation_id": "bad/id"})
        assert code == 422
        chat(http, "h", "hi")
        code, body = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                   "conversation_id": "h", "from_turn": 7})
        assert code == 404 and "no turn 7" in body["error"]["message"]
        code, body = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                   "conversation_id": "h", "branch": "missing"})
        assert code == 404 and "from_turn" in body["error"]["message"]
        assert post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                             "conversation_id": "h", "branch": ""})[0] == 422
        # A selector never falls back to another branch than the one it names.
        code, body = post("/delete_snapshot", {"conversation_id": "h", "branch_name": "typo", "turn_number": 1})
        assert code == 404 and "no branch 'typo'" in body["error"]["message"]
        assert post("/get_snapshot_info", {"conversation_id": "h", "snapshot_id": "../../x/1"})[0] == 422
        assert post("/get_snapshot_info", {"conversation_id": "h", "snapshot_id": "main/\u00b2"})[0] == 422
        assert post("/get_snapshot_info", {"conversation_id": "h", "snapshot_id": "main/1"})[0] == 200  # still there
        # A first turn that fails makes no conversation.
        assert post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                             "conversation_id": "ghost", "max_tokens": 5000})[0] == 400
        assert http.get("/v1/conversations/ghost").status_code == 404


def test_busy_conversation_gets_409(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "conversation_id": "busy",
                "temperature": 0, "max_tokens": 600, "ignore_eos": True}
        worker = threading.Thread(target=lambda: http.post("/v1/chat/completions", json=body))
        worker.start()
        try:
            for _ in range(200):
                if stats(srv).num_running:
                    break
                time.sleep(0.01)
            r = http.post("/v1/chat/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 409 and "in flight" in r.json()["error"]["message"]
        finally:
            worker.join()
        assert chat(http, "busy", "next")["turn"] == 2


def test_snapshot_of_another_model_or_damaged_file_is_refused(checkpoint_dir, tmp_path):
    """Restoring a damaged or foreign snapshot is refused; a conversation turn over a damaged one
    recomputes the history instead, and the file is quarantined."""
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        chat(http, "x", "hello")
    snapshot = tmp_path / "x" / "main" / "000001.safetensors"
    data = bytearray(snapshot.read_bytes())
    data[-5] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        r = http.post("/restore_snapshot", json={"conversation_id": "x", "turn_number": 1})
        message = r.json()["error"]["message"]
        assert r.status_code == 409 and message.startswith("x/main/000001.safetensors: checksum mismatch"), message
        assert str(tmp_path) not in message  # the server's own paths are not for its clients
        assert chat(http, "x", "x")["turn"] == 2
        held = srv.app.state.serving.conversations.manager.quarantine.list("x")
        assert [q["ref"] for q in held] == ["main/000001"] and "checksum mismatch" in held[0]["reason"]
    snapshot.write_bytes(bytes(data[:-5]) + bytes([data[-5] ^ 0xFF]) + bytes(data[-4:]))  # repaired
    with serving(checkpoint_dir("mamba2"), tmp_path) as (srv, http):  # another model, same folder
        r = http.post("/restore_snapshot", json={"conversation_id": "x", "turn_number": 1})
        assert r.status_code == 409 and "architecture" in r.json()["error"]["message"] and str(tmp_path) not in r.text
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):  # the right model again: it loads
        r = http.post("/restore_snapshot", json={"conversation_id": "x", "turn_number": 1})
        assert r.status_code == 200 and r.json()["success"]


def test_restoring_a_quarantined_snapshot_is_refused_under_refuse_restore(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path, snapshot_health_failure_policy="refuse_restore") as (srv, http):
        chat(http, "q", "hello")
        srv.app.state.serving.conversations.manager.quarantine.add("q", "main/000001", "layers.0.ssm RMS 20")
        r = http.post("/restore_snapshot", json={"conversation_id": "q", "turn_number": 1, "create_new_request": True})
        assert r.status_code == 409 and r.json()["error"]["code"] == "snapshot_quarantined"


def test_a_request_cancelled_while_its_turn_is_planned_leaves_the_conversation_free(checkpoint_dir):
    """The client leaves while `begin` still runs in its thread (a slow snapshot load): the
    conversation that thread reserves is released when it ends, not kept busy for good."""
    import asyncio

    from engine_utils import make_engine

    from engram.server.conversations import ConversationTurns
    from engram.state.conversations import ConversationManager, SnapshotPolicy
    from engram.state.identity import ModelIdentity, tokenizer_fingerprint
    from engram.state.store import WarmCache

    engine = make_engine(checkpoint_dir("mamba2"))
    manager = ConversationManager(engine.spec, engine.state_dtypes, ModelIdentity.of(engine.spec, engine.model_path),
                                  tokenizer_fingerprint(engine.model_path), SnapshotPolicy(), None, WarmCache(4, 1 << 30))
    plan_turn = manager.begin
    manager.begin = lambda *args: (time.sleep(0.3), plan_turn(*args))[1]
    turns = ConversationTurns(manager, engine.tokenizer)

    async def leave_early() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(turns.begin("c", None, None), 0.05)
        await asyncio.sleep(0.6)  # the thread finishes meanwhile

    asyncio.run(leave_early())
    assert plan_turn("c").turn == 1  # not refused as busy


@pytest.mark.parametrize("reply_ids", [b"e", b">", b"|", b"x", b"\xc3"], ids=["e", "gt", "bar", "x", "half-utf8"])
def test_a_reply_cut_short_is_closed_as_the_template_closes_it(reply_ids):
    """A reply cut by max_tokens lacks the template's end-of-turn text: the next turn feeds it, so
    the prompt equals the whole conversation's rendering, also when the reply's text is a piece of
    the template's markup or empty (half a UTF-8 character)."""
    from types import SimpleNamespace

    from engram.models.byte_tokenizer import build_byte_tokenizer
    from engram.server.conversations import ConversationTurns

    tokenizer = build_byte_tokenizer()
    user = {"role": "user", "content": "say one letter"}
    head = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    history_tokens = tokenizer.encode(head, add_special_tokens=False) + list(reply_ids)  # ids 0-255 are the bytes
    reply = {"role": "assistant", "content": tokenizer.decode(list(reply_ids)).replace("\ufffd", "")}
    plan = SimpleNamespace(history_messages=[user, reply], history_tokens=history_tokens, history_ends_with_reply=True)
    new = [{"role": "user", "content": "next"}]
    prompt = ConversationTurns(manager=None, tokenizer=tokenizer).prompt(plan, new)
    rest = tokenizer.apply_chat_template([user, reply, *new], add_generation_prompt=True, tokenize=False)[len(head) + len(reply["content"]):]
    assert prompt == history_tokens + tokenizer.encode(rest, add_special_tokens=False)


# Templates that put text after the end token (ChatML-like, as Granite's "<|end_of_text|>\n") or
# before it (Nemotron-like, trimming the content), on the byte tokenizer's special tokens.
TEMPLATE_AFTER_END = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
TEMPLATE_BEFORE_END = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}\n<|end|>\n{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("template, generated, fed", [
    (TEMPLATE_AFTER_END, b"Hi", "<|end|>\n"),  # cut by max_tokens: the whole closing
    (TEMPLATE_AFTER_END, b"Hi<|end|>", "\n"),  # stopped at EOS: only what follows it
    (TEMPLATE_BEFORE_END, b"Hi\n", "<|end|>\n"),  # the newline the template adds, generated
    (TEMPLATE_BEFORE_END, b"Hi<|end|>", "\n"),  # the model ended its turn without the newline
], ids=["after-cut", "after-eos", "before-newline", "before-eos"])
def test_the_closing_the_model_generated_is_not_fed_again(template, generated, fed):
    from types import SimpleNamespace

    from engram.models.byte_tokenizer import build_byte_tokenizer
    from engram.server.conversations import ConversationTurns

    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = template
    user = {"role": "user", "content": "hello"}
    head = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    history_tokens = tokenizer.encode(head + generated.decode(), add_special_tokens=False)
    reply = {"role": "assistant", "content": generated.decode().replace("<|end|>", "")}
    plan = SimpleNamespace(history_messages=[user, reply], history_tokens=history_tokens, history_ends_with_reply=True)
    new = [{"role": "user", "content": "next"}]
    prompt = ConversationTurns(manager=None, tokenizer=tokenizer).prompt(plan, new)
    fresh = tokenizer.apply_chat_template([user, reply, *new], add_generation_prompt=True, tokenize=False)
    rest = fresh[len(tokenizer.apply_chat_template([user, reply], tokenize=False)):]
    assert prompt == history_tokens + tokenizer.encode(fed + rest, add_special_tokens=False)


def test_a_storage_failure_is_a_503_that_names_no_path_and_the_turn_is_undone(checkpoint_dir, tmp_path, monkeypatch):
    """A full disk (or a folder the server may not write) while a turn records: a 503 with the
    system's reason and not the server's paths; the conversation is as before the turn."""
    import engram.state.conversations as conversations

    def full_disk(path, data):
        raise OSError(28, "No space left on device", str(path))

    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        chat(http, "disk", "hello")
        with monkeypatch.context() as m:
            m.setattr(conversations, "atomic_write", full_disk)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "more"}], "conversation_id": "disk", **GREEDY}
            r = http.post("/v1/chat/completions", json=body)
        error = r.json()["error"]
        assert r.status_code == 503 and error["code"] == "storage_unavailable", r.text
        assert "No space left on device" in error["message"] and str(tmp_path) not in error["message"]
        assert chat(http, "disk", "more")["turn"] == 2
