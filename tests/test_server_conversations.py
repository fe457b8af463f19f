"""Exact persistent conversations over HTTP: continued by conversation_id across a server restart,
and through restore-and-generate, equal to one request over the whole history."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time

import httpx
import pytest
from checkpoints import GDN_KINDS
from engine_utils import store_file
from server_utils import metric_value, running_server

from engram.client import EngramClient, SnapshotManager, SnapshotNotFoundError
from engram.models.builtin import DEMO_MODEL_DIR

MODEL = "m"
GREEDY = {"temperature": 0, "max_tokens": 10}
USER_TURNS = ["Hello there, how are you?", "Tell me about state space models.", "And what about attention?"]


@contextlib.contextmanager
def serving(path: str, snapshot_dir, engine_fields=None, **server_fields):
    with (
        running_server(path, MODEL, engine_fields, snapshot_dir=str(snapshot_dir), **server_fields) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as http,
    ):
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


@pytest.mark.parametrize("kind", ["mamba2", "nemotron", "falcon_h1", "demo", *GDN_KINDS, "lfm2", "kimi_linear"])
def test_three_turns_across_a_restart_equal_one_request_over_the_history(kind, checkpoint_dir, tmp_path):
    path = str(DEMO_MODEL_DIR) if kind == "demo" else checkpoint_dir(kind)  # demo: the shipped, trained weights
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
        full = http.post(
            "/generate",
            json={"input_ids": prompt3, "return_logprob": True, "top_logprobs_num": 5, "sampling_params": {"temperature": 0, "max_new_tokens": 10}},
        ).json()
        assert full["output_ids"] == fill3[len(prompt3) :]
        assert full["text"] == third["choices"][0]["message"]["content"]
        # the first new token's distribution: top-5 log-probabilities agree to 1e-4
        first_top = [t["logprob"] for t in third["choices"][0]["logprobs"]["content"][0]["top_logprobs"]]
        full_top = [logprob for logprob, _, _ in full["meta_info"]["output_top_logprobs"][0]]
        assert len(first_top) == len(full_top) == 5
        assert max(abs(a - b) for a, b in zip(first_top, full_top)) < 1e-4

        # the same through restore-and-generate from turn 2's snapshot
        continuation = prompt3[len(history) :]
        r = http.post(
            "/restore_snapshot",
            json={
                "conversation_id": "conv",
                "turn_number": 2,
                "create_new_request": True,
                "continuation_ids": continuation,
                "max_new_tokens": 10,
                "sampling_params": {"temperature": 0},
            },
        )
        assert r.status_code == 200, r.text
        restored = r.json()
        assert restored["success"] and restored["output_ids"] == full["output_ids"]
        assert restored["meta_info"]["cached_tokens"] == len(history) - 1


def test_the_turn_after_a_reply_ended_by_a_stop_token_continues_exactly(checkpoint_dir, tmp_path):
    """The reply's text leaves the stop token out, its history keeps it: the next turn equals one
    request over the whole history, and the reply text is what the history's tokens say."""
    with serving(checkpoint_dir("nemotron"), tmp_path) as (_, http):
        probe = chat(http, "probe", USER_TURNS[0], ignore_eos=True)
        reply = snapshot_info(http, "probe", 1)["fill_ids"][-probe["usage"]["completion_tokens"] :]
        stop = next(t for k, t in enumerate(reply) if k >= 2 and t not in reply[:k] and chr(t).isascii() and chr(t).isalnum())
        first = chat(http, "conv", USER_TURNS[0], ignore_eos=True, stop_token_ids=[stop])
        assert first["choices"][0]["stop_reason"] == stop
        history = snapshot_info(http, "conv", 1)["fill_ids"]
        assert history[-1] == stop and chr(stop) not in first["choices"][0]["message"]["content"]
        second = chat(http, "conv", USER_TURNS[1])
        fill = snapshot_info(http, "conv", 2)["fill_ids"]
        prompt = fill[: len(fill) - second["usage"]["completion_tokens"]]
        assert prompt[: len(history)] == history
        full = http.post("/generate", json={"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 10}}).json()
        assert full["output_ids"] == fill[len(prompt) :] and full["text"] == second["choices"][0]["message"]["content"]


def test_links_in_the_snapshot_folder_are_never_followed(checkpoint_dir, tmp_path, caplog):
    """A conversation folder, snapshot file or record that is a symbolic link (to files outside the
    folder) is refused with a 409 that says so, and logged: nothing outside is read, written or
    deleted, through any route, for a conversation loaded before or after the link was made."""
    path, root, outside = checkpoint_dir("nemotron"), tmp_path / "snapshots", tmp_path / "outside"
    outside.mkdir()

    def link(inside: str, target: str) -> None:
        shutil.move(root / inside, outside / target)
        (root / inside).symlink_to(outside / target)

    with serving(path, root) as (_, http):
        for cid in ("folder", "snapshot", "record"):
            chat(http, cid, "hi")
    link("folder", "folder")
    link("snapshot/main/000001.json", "snapshot.json")
    link("record/conversation.json", "record.json")
    with serving(path, root) as (_, http):
        chat(http, "loaded", "hi")
        link("loaded", "loaded")  # its record is in memory already
        untouched = {p: p.read_bytes() if p.is_file() else None for p in outside.rglob("*")}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **GREEDY}
        for cid in ("folder", "snapshot", "record", "loaded"):
            answers = [
                http.post("/v1/chat/completions", json={**body, "conversation_id": cid}),
                http.post("/get_snapshot_info", json={"conversation_id": cid}),
                http.post("/delete_snapshot", json={"conversation_id": cid}),
                http.delete(f"/v1/conversations/{cid}"),
            ]
            if cid != "loaded":  # its record and state are in memory: these read no file
                answers += [http.get(f"/v1/conversations/{cid}"), http.post("/restore_snapshot", json={"conversation_id": cid})]
            for r in answers:
                assert r.status_code == 409, (cid, r.request.url, r.text)
                assert r.json()["error"]["code"] == "snapshot_link_refused" and "symbolic link" in r.text
                assert str(tmp_path) not in r.text
        listed = http.post("/list_snapshots", json={})
        assert listed.status_code == 200 and listed.json()["snapshots"] == []
    assert {p: p.read_bytes() if p.is_file() else None for p in outside.rglob("*")} == untouched
    assert all((root / p).is_symlink() for p in ("folder", "snapshot/main/000001.json", "record/conversation.json", "loaded"))
    assert "symbolic link under the snapshot folder is never followed" in caplog.text


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
        assert info["fill_ids"] == listed[0]["fill_ids"] and info["manifest"]["format"] == "engram-state/2"
        assert len(info["fill_ids"]) == info["token_count"] == info["state_len"] + 1

        # save by the rid of the request that made a turn
        rid = conv.last_response["id"]
        assert snaps.save(rid=rid)["turn_number"] == 2

        # restore-only stages the state for /generate with that rid: only the new tokens are computed
        staged = http.post("/restore_snapshot", json={"conversation_id": "c", "rid": "again"}).json()
        assert staged["success"] and staged["state_len"] == info["state_len"]
        before = stats(srv).prefill_tokens_computed_total
        r = http.post(
            "/generate", json={"rid": "again", "input_ids": info["fill_ids"] + [65, 66], "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
        ).json()
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


def test_a_forked_client_conversation_starts_from_the_turn_it_forks(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, _):
        conv = EngramClient(srv.url).conversation("f", temperature=0, max_tokens=4)
        first = conv.chat("first")
        conv.chat("second")
        fork = conv.fork("alt", from_turn=1)
        fork.chat("second")  # its first chat forks from turn 1; the next ones continue the branch
        fork.chat("third")
        assert (fork.last_response["branch"], fork.turn) == ("alt", 3)
        alt = EngramClient(srv.url).get_conversation("f")["branches"]["alt"]
        assert [m["content"] for m in alt["messages"]][:2] == ["first", first]


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
        code, body = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "conversation_id": "bad/id"})
        assert code == 422
        chat(http, "h", "hi")
        code, body = post(
            "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "conversation_id": "h", "from_turn": 7}
        )
        assert code == 404 and "no turn 7" in body["error"]["message"]
        code, body = post(
            "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "conversation_id": "h", "branch": "missing"}
        )
        assert code == 404 and "from_turn" in body["error"]["message"]
        assert (
            post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "conversation_id": "h", "branch": ""})[0]
            == 422
        )
        for where in (
            {"conversation_id": "h", "branch": ".x.tmp-0123456789ab-01234567", "from_turn": 1},
            {"conversation_id": ".h"},
        ):  # a leading dot is the folder's own (temp files)
            code, body = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **where})
            assert code == 422 and "not beginning with '.'" in body["error"]["message"]
        # A selector never falls back to another branch than the one it names.
        code, body = post("/delete_snapshot", {"conversation_id": "h", "branch_name": "typo", "turn_number": 1})
        assert code == 404 and "no branch 'typo'" in body["error"]["message"]
        assert post("/get_snapshot_info", {"conversation_id": "h", "snapshot_id": "../../x/1"})[0] == 422
        assert post("/get_snapshot_info", {"conversation_id": "h", "snapshot_id": "main/\u00b2"})[0] == 422
        assert post("/get_snapshot_info", {"conversation_id": "h", "snapshot_id": "main/1"})[0] == 200  # still there
        # A first turn that fails makes no conversation.
        assert (
            post(
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "conversation_id": "ghost", "max_tokens": 5000},
            )[0]
            == 400
        )
        assert http.get("/v1/conversations/ghost").status_code == 404


def test_busy_conversation_gets_409(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "long"}],
            "conversation_id": "busy",
            "temperature": 0,
            "max_tokens": 600,
            "ignore_eos": True,
        }
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
    snapshot = store_file(tmp_path / "x" / "main" / "000001.json", piece=0)  # one KV piece of turn 1
    data = bytearray(snapshot.read_bytes())
    data[-5] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        r = http.post("/restore_snapshot", json={"conversation_id": "x", "turn_number": 1})
        message = r.json()["error"]["message"]
        assert r.status_code == 409 and message.startswith("x/main/000001.json: store file") and "checksum mismatch" in message, message
        assert str(tmp_path) not in message  # the server's own paths are not for its clients
        assert chat(http, "x", "x")["turn"] == 2
        held = srv.app.state.serving.conversations.manager.quarantine.list("x")
        assert [q["ref"] for q in held] == ["main/000001"] and "damaged" in held[0]["reason"]  # set aside by the restore
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
    manager = ConversationManager(
        engine.spec,
        engine.state_dtypes,
        ModelIdentity.of(engine.spec, engine.model_path),
        tokenizer_fingerprint(engine.model_path),
        SnapshotPolicy(),
        None,
        WarmCache(4, 1 << 30),
    )
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
    rest = tokenizer.apply_chat_template([user, reply, *new], add_generation_prompt=True, tokenize=False)[len(head) + len(reply["content"]) :]
    assert prompt == history_tokens + tokenizer.encode(rest, add_special_tokens=False)


# Templates that put text after the end token (ChatML-like, as Granite's "<|end_of_text|>\n") or
# before it (Nemotron-like, trimming the content), on the byte tokenizer's special tokens.
TEMPLATE_AFTER_END = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEMPLATE_BEFORE_END = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}\n<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize(
    "template, generated, fed",
    [
        (TEMPLATE_AFTER_END, b"Hi", "<|end|>\n"),  # cut by max_tokens: the whole closing
        (TEMPLATE_AFTER_END, b"Hi<|end|>", "\n"),  # stopped at EOS: only what follows it
        (TEMPLATE_BEFORE_END, b"Hi\n", "<|end|>\n"),  # the newline the template adds, generated
        (TEMPLATE_BEFORE_END, b"Hi<|end|>", "\n"),  # the model ended its turn without the newline
    ],
    ids=["after-cut", "after-eos", "before-newline", "before-eos"],
)
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
    rest = fresh[len(tokenizer.apply_chat_template([user, reply], tokenize=False)) :]
    assert prompt == history_tokens + tokenizer.encode(fed + rest, add_special_tokens=False)


def test_a_storage_failure_is_a_503_that_names_no_path_and_the_turn_is_undone(checkpoint_dir, tmp_path, monkeypatch):
    """A full disk (or a folder the server may not write) while a turn records: a 503 with the
    system's reason and not the server's paths; the conversation is as before the turn."""
    import engram.state.records as records

    def full_disk(path, data):
        raise OSError(28, "No space left on device", str(path))

    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        chat(http, "disk", "hello")
        with monkeypatch.context() as m:
            m.setattr(records, "atomic_write", full_disk)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "more"}], "conversation_id": "disk", **GREEDY}
            r = http.post("/v1/chat/completions", json=body)
        error = r.json()["error"]
        assert r.status_code == 503 and error["code"] == "storage_unavailable", r.text
        assert "No space left on device" in error["message"] and str(tmp_path) not in error["message"]
        assert chat(http, "disk", "more")["turn"] == 2


TEMPLATE_DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|system|>You are helpful.<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEMPLATE_ALTERNATING = (
    "{% for m in messages if m['role'] != 'system' %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEMPLATE_NUMBERED = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ loop.index }}. {{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize(
    "template",
    [None, TEMPLATE_AFTER_END, TEMPLATE_BEFORE_END, TEMPLATE_DEFAULT_SYSTEM, TEMPLATE_ALTERNATING, TEMPLATE_NUMBERED],
    ids=["byte", "after-end", "before-end", "default-system", "alternating", "numbered"],
)
@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("cut", [False, True], ids=["closed", "cut"])
def test_a_turn_renders_only_the_tail_and_equals_the_whole_rendering(template, system, cut):
    """The prompt of each turn of a long conversation equals the one from rendering the whole
    conversation (the way every turn was rendered before), whether the last reply was closed or cut
    short; the template sees only the conversation's tail where that gives the same text."""
    from types import SimpleNamespace

    from engram.models.byte_tokenizer import build_byte_tokenizer
    from engram.server.conversations import TAIL_WINDOWS, ConversationTurns

    tokenizer = build_byte_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    rendered_lengths = []
    render = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda messages, **kw: (rendered_lengths.append(len(messages)), render(messages, **kw))[1]
    turns = ConversationTurns(manager=None, tokenizer=tokenizer)
    history = [{"role": "system", "content": "Be brief."}] if system else []
    for i in range(8):
        history += [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}"}]
        closed = render(history, tokenize=False)
        text = render(history[:-1], add_generation_prompt=True, tokenize=False) + history[-1]["content"] if cut else closed
        plan = SimpleNamespace(
            history_messages=list(history), history_tokens=tokenizer.encode(text, add_special_tokens=False), history_ends_with_reply=True
        )
        new = [{"role": "user", "content": f"next {i}"}]
        rendered_lengths.clear()
        prompt = turns.prompt(plan, new)
        tail_rendered = max(rendered_lengths)
        whole = plan.history_tokens + tokenizer.encode(turns._delta(history, new, plan, True), add_special_tokens=False)
        assert prompt == whole
        if len(history) > system + max(TAIL_WINDOWS):  # long enough for the tail
            assert (tail_rendered == len(history) + 1) == (template == TEMPLATE_NUMBERED), rendered_lengths


def stream_chat(http, conversation_id, text):
    """Stream a turn, reading up to its finish chunk: (the events read, the conversation's record
    on disk as it was when the finish chunk arrived, or None)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "conversation_id": conversation_id, "stream": True, **GREEDY}
    events, record = [], None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: ") :]))
                if any(c.get("finish_reason") for c in events[-1].get("choices", [])):
                    return events, http.get(f"/v1/conversations/{conversation_id}").json()
    return events, record


def test_a_streamed_turn_sends_its_finish_chunk_only_once_recorded(checkpoint_dir, tmp_path, monkeypatch):
    """Sync durability: the finish chunk comes after the record is on disk; a record that cannot
    be written is an in-band error in its place, and the turn is not kept."""
    from engram.state import records

    with serving(checkpoint_dir("nemotron"), tmp_path) as (_, http):
        events, _ = stream_chat(http, "sse", "hello")
        on_disk = json.loads((tmp_path / "sse" / records.RECORD_NAME).read_text())
        assert [t["turn"] for t in on_disk["turns"]] == [1] and events[-1]["turn"] == 1
        real_write = records.atomic_write

        def full_disk(path, data):
            if path.name == records.RECORD_NAME:
                raise OSError(28, "No space left on device")
            real_write(path, data)

        with monkeypatch.context() as m:
            m.setattr(records, "atomic_write", full_disk)
            events, _ = stream_chat(http, "sse", "more")
        assert not any(c.get("finish_reason") for e in events for c in e.get("choices", []))
        assert events[-1]["error"]["code"] == "storage_unavailable", events[-1]
        assert http.get("/v1/conversations/sse").json()["branches"]["main"]["latest_turn"] == 1
        assert chat(http, "sse", "more")["turn"] == 2


def test_a_client_that_leaves_right_after_the_finish_chunk_keeps_its_turn(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path) as (_, http):
        for turn in (1, 2, 3):
            events, record = stream_chat(http, "gone", f"message {turn}")  # closes the stream there
            assert events[-1]["turn"] == turn and record["branches"]["main"]["latest_turn"] == turn
        assert chat(http, "gone", "next")["turn"] == 4
    with serving(checkpoint_dir("nemotron"), tmp_path) as (_, http):
        assert chat(http, "gone", "after a restart")["turn"] == 5


def conversation_manager(engine, root):
    """A ConversationManager over an in-process engine (every-turn snapshots under `root`)."""
    from engram.state.conversations import ConversationManager, SnapshotPolicy
    from engram.state.identity import ModelIdentity, tokenizer_fingerprint
    from engram.state.store import WarmCache

    return ConversationManager(
        engine.spec,
        engine.state_dtypes,
        ModelIdentity.of(engine.spec, engine.model_path),
        tokenizer_fingerprint(engine.model_path),
        SnapshotPolicy(),
        root,
        WarmCache(4, 1 << 30),
    )


def test_recording_a_finished_turn_outlives_the_cancellation_of_its_request(checkpoint_dir, tmp_path):
    """The client leaves while the turn is recorded and the server's threads are all busy (the
    record waits for one): the turn is recorded all the same and the conversation freed."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from engine_utils import greedy, make_engine, random_prompt, run_to_end

    from engram.server.conversations import ConversationTurns

    engine = make_engine(checkpoint_dir("mamba2"))
    manager = conversation_manager(engine, tmp_path)
    plan = manager.begin("left")
    engine.add_request("r", random_prompt(6, 1), greedy(3), capture_state=True)
    finished = run_to_end(engine)["r"]
    turns = ConversationTurns(manager, engine.tokenizer)

    async def outputs():
        yield finished

    async def consume() -> None:
        async for _ in turns.record("r", plan, [{"role": "user", "content": "hi"}], outputs()):
            pass

    async def leave_while_recording() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        threads_free = threading.Event()
        busy = loop.run_in_executor(None, threads_free.wait)
        request = asyncio.ensure_future(consume())
        for _ in range(10):  # up to where the record waits for a thread
            await asyncio.sleep(0)
        request.cancel()
        threads_free.set()
        await asyncio.gather(request, return_exceptions=True)
        await busy
        await loop.run_in_executor(None, lambda: None)  # after every job queued before it

    asyncio.run(leave_while_recording())
    assert manager.require("left").latest("main").turn == 1
    assert manager.begin("left").turn == 2  # not refused as busy


def test_a_turn_preempted_while_its_last_token_is_in_flight_is_recorded(checkpoint_dir, tmp_path):
    """Overlapped steps: the turn's last token is in flight when another sequence's growth
    preempts it, so it finishes without a state. It is answered, so it is recorded; the next
    turn recomputes its history, exactly."""
    import asyncio

    from engine_utils import greedy, make_engine, random_prompt, run_to_end

    from engram.server.conversations import ConversationTurns
    from engram.state.conversations import retain_key

    path = checkpoint_dir("nemotron")
    engine = make_engine(path, max_total_tokens=64, context_length=64, kv_block_size=16, max_running_requests=4)
    manager = conversation_manager(engine, tmp_path)
    plan = manager.begin("pre")
    prompt = random_prompt(40, 2)  # 3 of the 4 KV pages
    engine.add_request("other", random_prompt(16, 1), greedy(8))  # its 17th token needs the 4th page's successor
    engine.add_request("turn", prompt, greedy(1), capture_state=True, retain_key=retain_key("pre", plan.ref))
    finished = run_to_end(engine)["turn"]
    assert engine.stats().num_preemptions == 1 and finished.state is None and finished.finish_reason.value == "length"

    async def outputs():
        yield finished

    async def consume() -> None:
        async for _ in ConversationTurns(manager, engine.tokenizer).record("turn", plan, [{"role": "user", "content": "hi"}], outputs()):
            pass

    asyncio.run(consume())
    history = prompt + finished.token_ids
    for current in (manager, conversation_manager(engine, tmp_path)):  # and after a restart
        conv = current.require("pre")
        assert conv.latest("main").turn == 1 and conv.tokens(conv.latest("main")) == history
    follow = manager.begin("pre")
    assert follow.turn == 2 and follow.state is None and follow.history_tokens == history
    new = random_prompt(5, 3)
    engine.add_request("next", history + new, greedy(4))
    fresh = make_engine(path)
    fresh.add_request("full", history + new, greedy(4))
    assert run_to_end(engine)["next"].token_ids == run_to_end(fresh)["full"].token_ids


def test_a_conversation_exported_and_imported_elsewhere_continues_exactly(checkpoint_dir, tmp_path):
    """An export is one file that another server imports (under a new id), verifies, and continues
    from the stored state as the first server would have; damaged or foreign files are refused whole."""
    path = checkpoint_dir("nemotron")
    with serving(path, tmp_path / "a") as (_, http):
        for text in USER_TURNS[:2]:
            chat(http, "src", text)
        exported = http.get("/v1/conversations/src/export")
        assert exported.status_code == 200 and exported.headers["content-type"] == "application/x-tar"
        assert http.get("/v1/conversations/none/export").status_code == 404
    data = exported.content
    with serving(checkpoint_dir("mamba2"), tmp_path / "other") as (_, http):  # another model: refused, nothing listed
        r = http.post("/v1/conversations/import", content=data)
        assert r.status_code == 409 and "model" in r.json()["error"]["message"], r.text
        assert http.get("/v1/conversations/src").status_code == 404
    with serving(path, tmp_path / "b") as (srv, http):
        damaged = bytearray(data)
        damaged[len(damaged) // 2] ^= 0xFF  # somewhere in the store files' tensors
        assert http.post("/v1/conversations/import", params={"conversation_id": "bad"}, content=bytes(damaged)).status_code == 409
        assert http.get("/v1/conversations/bad").status_code == 404
        r = http.post("/v1/conversations/import", params={"conversation_id": "moved"}, content=data)
        assert r.status_code == 200 and r.json()["latest_turns"] == {"main": 2} and r.json()["snapshots"] == 2, r.text
        assert http.post("/v1/conversations/import", params={"conversation_id": "moved"}, content=data).status_code == 409
        history = snapshot_info(http, "moved", 2)["fill_ids"]
        third = chat(http, "moved", USER_TURNS[2])
        assert third["turn"] == 3 and third["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) - 1
        fill3 = snapshot_info(http, "moved", 3)["fill_ids"]
        prompt3 = fill3[: len(fill3) - third["usage"]["completion_tokens"]]
        full = http.post("/generate", json={"input_ids": prompt3, "sampling_params": {"temperature": 0, "max_new_tokens": 10}}).json()
        assert prompt3[: len(history)] == history and full["output_ids"] == fill3[len(prompt3) :]


def test_a_turn_preempted_over_http_while_its_last_token_is_in_flight_is_recorded(checkpoint_dir, tmp_path):
    """The engine-level test above, through HTTP with concurrent clients. Two slots and 23 KV
    pages: two completion choices (started together, so they end in the same step) hold both
    slots while `other` (20 pages of prompt) and then the turn (3 pages) queue; the choices end,
    both are admitted in one step, and `other`'s next token needs a 24th page: the turn, admitted
    last, is preempted with its one token in flight. It is answered, so it must be recorded; the
    next turn recomputes its history and equals /generate over it."""
    from engram.args import EngineArgs, ServerArgs
    from engram.launch_server import build_app
    from engram.server.background import BackgroundServer

    path = checkpoint_dir("nemotron")
    engine_args = EngineArgs(model_path=str(path), max_running_requests=2, max_total_tokens=23 * 16, kv_block_size=16, context_length=368)
    with (
        BackgroundServer(build_app(engine_args, ServerArgs(served_model_name=MODEL, snapshot_dir=str(tmp_path)))) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as http,
    ):
        text = "x" * 30
        prompt = http.post("/tokenize", json={"messages": [{"role": "user", "content": text}], "add_generation_prompt": True}).json()
        text += "x" * (40 - prompt["count"])  # the turn's prompt: 40 tokens, 3 pages
        engine = srv.app.state.serving.engine.engine

        def waiting(n: int) -> None:
            deadline = time.monotonic() + 60
            while engine.stats().num_waiting < n:
                assert time.monotonic() < deadline and not results, f"the request did not queue: {results}"
                time.sleep(0.005)

        sampling = {"temperature": 0, "ignore_eos": True}
        results: dict[str, httpx.Response] = {}

        def send(name: str, route: str, body: dict) -> threading.Thread:
            thread = threading.Thread(target=lambda: results.__setitem__(name, http.post(route, json=body)))
            thread.start()
            return thread

        threads = [send("choices", "/v1/completions", {"model": MODEL, "prompt": [1], "n": 2, "max_tokens": 170, **sampling})]
        while engine.stats().state_slots_used < 2:
            time.sleep(0.005)
        threads.append(
            send("other", "/generate", {"input_ids": [3 + i % 250 for i in range(320)], "sampling_params": {"max_new_tokens": 4, **sampling}})
        )
        waiting(1)
        threads.append(
            send(
                "turn",
                "/v1/chat/completions",
                {"model": MODEL, "conversation_id": "pre", "max_tokens": 1, "messages": [{"role": "user", "content": text}], **sampling},
            )
        )
        waiting(2)
        for thread in threads:
            thread.join()
        assert all(r.status_code == 200 for r in results.values()), {k: r.text for k, r in results.items()}
        assert engine.stats().num_preemptions == 1 and results["turn"].json()["turn"] == 1
        record = http.get("/v1/conversations/pre")
        assert record.status_code == 200, record.text  # the answered turn was recorded
        assert [(t["turn"], t["state_len"], t["snapshot"]) for t in record.json()["turns"]] == [(1, 0, False)]  # without a state
        reply = chat(http, "pre", "and then")
        assert reply["turn"] == 2 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed
        fill = snapshot_info(http, "pre", 2)["fill_ids"]
        prompt_ids = fill[: len(fill) - reply["usage"]["completion_tokens"]]
        full = http.post("/generate", json={"input_ids": prompt_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 10}}).json()
        assert full["output_ids"] == fill[len(prompt_ids) :] and full["text"] == reply["choices"][0]["message"]["content"]


def test_a_slot_the_engine_reclaims_leaves_the_active_tier_at_once(checkpoint_dir, tmp_path):
    """Memory pressure: a request of no conversation needs the KV pages a finished turn's slot
    holds; the scheduler reclaims them, and the tier report says so before any maintenance runs."""
    with serving(checkpoint_dir("nemotron"), tmp_path, engine_fields={"max_total_tokens": 512, "context_length": 512}) as (srv, http):
        chat(http, "a", "hello")

        def tiers():
            turns = http.get("/v1/conversations/a").json()["turns"]
            active = metric_value(http.get("/metrics").text, "engram:state_tier_entries", model_name=MODEL, tier="active")
            return [t["tier"] for t in turns], active, http.get("/v1/state/stats").json()["tiers"]["active"]["turns"]

        assert tiers() == (["active"], 1.0, 1)
        long = {"input_ids": [3 + i % 200 for i in range(500)], "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
        assert http.post("/generate", json=long).status_code == 200  # every KV page: the retained slot's too
        assert stats(srv).retained_slots == 0
        assert tiers() == (["warm"], 0.0, 0)
        history = snapshot_info(http, "a", 1)["fill_ids"]
        assert chat(http, "a", "more")["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) - 1  # from the warm copy


def test_each_turn_copies_only_its_new_tokens_state_to_the_host(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        engine = srv.app.state.serving.engine.engine  # the LLMEngine behind the AsyncEngine
        a = engine.spec.attention
        per_token = 2 * len(engine.spec.attention_layers) * a.num_kv_heads * a.head_dim * engine.state_dtypes.kv.itemsize
        recurrent = sum(t.numel() * t.element_size() for t in engine.state_pool.views(0).values())
        held, copied = 0, []
        for text in USER_TURNS:
            before = metric_value(http.get("/metrics").text, "engram:capture_bytes_total", model_name=MODEL)
            turn = chat(http, "c", text)["turn"]
            copied.append(metric_value(http.get("/metrics").text, "engram:capture_bytes_total", model_name=MODEL) - before)
            state_len = len(snapshot_info(http, "c", turn)["fill_ids"]) - 1  # the reply's last token is not yet consumed
            assert copied[-1] <= (state_len - held) * per_token + recurrent, (turn, copied, state_len, held)
            held = state_len
        assert copied[0] > recurrent  # the first turn copies its whole history's KV


def test_a_routing_header_naming_another_conversation_is_refused(checkpoint_dir, tmp_path):
    """X-Conversation-Id (the router's key, docs/DEPLOYMENT.md) must be the body's conversation_id."""
    with serving(checkpoint_dir("nemotron"), tmp_path) as (srv, http):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "conversation_id": "a", **GREEDY}
        r = http.post("/v1/chat/completions", json=body, headers={"X-Conversation-Id": "b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Conversation-Id", r.text
        assert http.post("/v1/chat/completions", json=body, headers={"X-Conversation-Id": "a"}).status_code == 200
