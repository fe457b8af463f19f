"""Tenants: each user key sees only the conversations it made (others' are not found, on every
route), the admin key sees all, `--api-keys-file` is re-read on SIGHUP."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import pytest
from server_utils import ServerProcess, running_server
from test_crash_recovery import serve_args

from engram.server.auth import key_name, read_keys_file

MODEL = "m"
ALICE, BOB, ADMIN = "alice-secret", "bob-secret", "admin-secret"


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@contextlib.contextmanager
def serving(path, snapshot_dir, **fields):
    with running_server(path, MODEL, snapshot_dir=str(snapshot_dir), **fields) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        yield srv, http


def chat(http, key, conversation_id, text="hello", expect=200):
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "conversation_id": conversation_id, "temperature": 0, "max_tokens": 3}
    r = http.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert r.status_code == expect, r.text
    return r.json()


def listed(http, key, **params):
    r = http.get("/v1/conversations", params=params, headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()


def test_a_tenant_reaches_only_its_own_conversations(checkpoint_dir, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# tenants\ncarol: carol-secret\n")
    with serving(checkpoint_dir("nemotron"), tmp_path / "snaps", api_key=[ALICE, BOB], api_keys_file=str(keys_file), admin_api_key=ADMIN) as (
        srv,
        http,
    ):
        chat(http, ALICE, "a1")
        chat(http, "carol-secret", "c1")
        missing = http.get("/v1/conversations/nope", headers=bearer(BOB)).json()["error"]["message"].replace("nope", "a1")
        for method, path, body in [
            (
                "POST",
                "/v1/chat/completions",
                {"model": MODEL, "conversation_id": "a1", "max_tokens": 2, "messages": [{"role": "user", "content": "mine now"}]},
            ),
            ("GET", "/v1/conversations/a1", None),
            ("DELETE", "/v1/conversations/a1", None),
        ]:
            r = http.request(method, path, json=body, headers=bearer(BOB))
            assert r.status_code == 404 and r.json()["error"]["message"] == missing, (path, r.text)  # as if missing
        assert http.post("/list_snapshots", json={}, headers=bearer(BOB)).status_code == 401  # admin routes: admin key

        mine = http.get("/v1/conversations/a1", headers=bearer(ALICE)).json()
        assert mine["owner"] == key_name(ALICE) and mine["branches"]["main"]["latest_turn"] == 1
        assert chat(http, ALICE, "a1", "again")["turn"] == 2  # the owner goes on
        assert http.get("/v1/conversations/c1", headers=bearer("carol-secret")).json()["owner"] == "carol"
        assert [c["id"] for c in listed(http, ALICE)["data"]] == ["a1"]
        assert listed(http, BOB)["data"] == []
        assert [c["id"] for c in listed(http, ADMIN)["data"]] == ["a1", "c1"]
        assert http.get("/v1/conversations/a1", headers=bearer(ADMIN)).status_code == 200
        assert http.post("/get_snapshot_info", json={"conversation_id": "c1"}, headers=bearer(ADMIN)).status_code == 200

        # /v1/state/stats names other tenants' conversations to admins only
        srv.app.state.serving.conversations.manager.quarantine.add("a1", "main/000001", "test")
        quarantined = {
            key: [q["conversation_id"] for q in http.get("/v1/state/stats", headers=bearer(key)).json()["quarantined"]] for key in (ALICE, BOB, ADMIN)
        }
        assert quarantined == {ALICE: ["a1"], BOB: [], ADMIN: ["a1"]}

        assert http.delete("/v1/conversations/a1", headers=bearer(ALICE)).status_code == 200
        assert http.get("/v1/conversations/a1", headers=bearer(ADMIN)).status_code == 404


def test_the_conversation_list_is_paged(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path, api_key=ALICE) as (_, http):
        for cid in ("x3", "x1", "x2"):
            chat(http, ALICE, cid)
        first = listed(http, ALICE, limit=2)
        assert ([c["id"] for c in first["data"]], first["has_more"], first["last_id"]) == (["x1", "x2"], True, "x2")
        rest = listed(http, ALICE, limit=2, after=first["last_id"])
        assert ([c["id"] for c in rest["data"]], rest["has_more"]) == (["x3"], False)
        assert rest["data"][0]["latest_turns"] == {"main": 1}
        r = http.get("/v1/conversations", params={"limit": 0}, headers=bearer(ALICE))
        assert r.status_code == 400 and "limit" in r.json()["error"]["message"]


def test_without_an_admin_key_the_snapshot_routes_are_scoped_to_the_tenant(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path, api_key=[ALICE, BOB]) as (_, http):
        chat(http, ALICE, "a1")
        chat(http, BOB, "b1")
        for path in ("/get_snapshot_info", "/restore_snapshot", "/delete_snapshot", "/save_snapshot"):
            r = http.post(path, json={"conversation_id": "a1"}, headers=bearer(BOB))
            assert r.status_code == 404, (path, r.text)
        snapshots = http.post("/list_snapshots", json={}, headers=bearer(BOB)).json()["snapshots"]
        assert [s["conversation_id"] for s in snapshots] == ["b1"]
        rid = chat(http, ALICE, "a1", "two")["id"]
        assert http.post("/save_snapshot", json={"rid": rid}, headers=bearer(BOB)).status_code == 404
        assert http.post("/save_snapshot", json={"rid": rid}, headers=bearer(ALICE)).status_code == 200


def test_a_state_staged_for_a_rid_is_taken_only_by_its_tenants_generate(checkpoint_dir, tmp_path):
    """/restore_snapshot with a rid stages a state for the /generate of that rid: another tenant's
    /generate of the same rid neither takes it nor learns of it (a staged state that does not start
    a prompt is refused with its length)."""
    with serving(checkpoint_dir("nemotron"), tmp_path, api_key=[ALICE, BOB]) as (_, http):
        chat(http, ALICE, "a1")
        info = http.post("/get_snapshot_info", json={"conversation_id": "a1"}, headers=bearer(ALICE)).json()
        staged = http.post("/restore_snapshot", json={"conversation_id": "a1", "rid": "r"}, headers=bearer(ALICE))
        assert staged.status_code == 200, staged.text

        def generate(key, input_ids):
            body = {"input_ids": input_ids, "rid": "r", "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
            r = http.post("/generate", json=body, headers=bearer(key))
            assert r.status_code == 200, r.text
            return r.json()["meta_info"]["cached_tokens"]

        assert generate(BOB, [5, 6, 7]) == 0  # not refused, not restored from alice's state
        assert generate(ALICE, info["fill_ids"] + [5, 6, 7]) == info["state_len"]  # still staged for her


def test_a_tenants_request_ids_are_its_own(checkpoint_dir, tmp_path):
    """Without an admin key the user keys open /abort_request: each reaches only its own requests,
    by rid or all; a rid another tenant's running request carries is free (not "already in use")."""
    with serving(checkpoint_dir("nemotron"), tmp_path, api_key=[ALICE, BOB]) as (srv, http):
        engine = srv.app.state.serving.engine.engine
        long = {"input_ids": [5, 6, 7], "rid": "x", "stream": True, "sampling_params": {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}}
        with http.stream("POST", "/generate", json=long, headers=bearer(ALICE)) as alice:
            events = (json.loads(line[6:]) for line in alice.iter_lines() if line.startswith("data: {"))
            assert next(events)["meta_info"]["finish_reason"] is None  # running
            short = {"input_ids": [5, 6], "rid": "x", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
            r = http.post("/generate", json=short, headers=bearer(BOB))
            assert r.status_code == 200, r.text
            for body in ({"rid": "x"}, {"abort_all": True}):
                assert http.post("/abort_request", json=body, headers=bearer(BOB)).json() == {"success": True}
            assert engine.stats().num_running == 1  # alice's request goes on
            assert http.post("/abort_request", json={"rid": "x"}, headers=bearer(ALICE)).json() == {"success": True}
            last = list(events)[-1]["meta_info"]
        assert last["finish_reason"]["type"] == "abort" and last["completion_tokens"] < 900


def test_conversations_made_without_keys_are_seen_only_by_the_admin_key(checkpoint_dir, tmp_path):
    path = checkpoint_dir("nemotron")
    with serving(path, tmp_path) as (_, http):  # no keys: open, as before tenants
        chat(http, None, "old")
        assert [c["id"] for c in listed(http, None)["data"]] == ["old"]
    with serving(path, tmp_path, api_key=ALICE, admin_api_key=ADMIN) as (_, http):
        assert http.get("/v1/conversations/old", headers=bearer(ALICE)).status_code == 404
        chat(http, ALICE, "old", expect=404)
        assert listed(http, ALICE)["data"] == []
        got = http.get("/v1/conversations/old", headers=bearer(ADMIN)).json()
        assert got["owner"] is None and got["branches"]["main"]["latest_turn"] == 1


@pytest.mark.parametrize(
    "text, says",
    [
        ("s3cr3t\n", "line 1"),
        ("a: s3cr3t\nb: s3cr3t\n", "line 2: its key is given twice"),
        ("a: s3cr3t\na: j\n", "line 2: the name 'a' is given twice"),
        ("\nbad name: s3cr3t\n", "line 2"),
    ],
)
def test_a_malformed_keys_file_is_refused_naming_the_line(tmp_path, text, says):
    (tmp_path / "keys").write_text(text)
    with pytest.raises(ValueError, match=says) as e:
        read_keys_file(tmp_path / "keys")
    assert "s3cr3t" not in str(e.value)  # never the key


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="needs POSIX signals")
def test_sighup_reloads_the_keys_file(checkpoint_dir, tmp_path):
    keys_file, log = tmp_path / "keys", tmp_path / "log"
    keys_file.write_text("alice: alice-secret\n")
    server = ServerProcess(serve_args(checkpoint_dir("nemotron"), tmp_path / "snaps", "--api-keys-file", str(keys_file)), log)
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            chat(http, "alice-secret", "a1")
            assert http.get("/v1/models", headers=bearer("bob-secret")).status_code == 401
            keys_file.write_text("bob: bob-secret\n")
            os.kill(server.pid, signal.SIGHUP)
            for _ in range(100):  # the handler runs on the server's loop, soon after the signal
                if http.get("/v1/models", headers=bearer("bob-secret")).status_code == 200:
                    break
                time.sleep(0.05)
            assert http.get("/v1/models", headers=bearer("bob-secret")).status_code == 200
            assert http.get("/v1/models", headers=bearer("alice-secret")).status_code == 401
            assert http.get("/v1/conversations/a1", headers=bearer("bob-secret")).status_code == 404
            keys_file.write_text("bob\n")  # malformed: the keys in force stay
            os.kill(server.pid, signal.SIGHUP)
            for _ in range(100):
                if "API keys not reloaded" in log.read_text():
                    break
                time.sleep(0.05)
            assert "--api-keys-file line 1" in log.read_text() and "bob-secret" not in log.read_text()
            assert http.get("/v1/models", headers=bearer("bob-secret")).status_code == 200
            assert http.get("/v1/models").status_code == 401
    finally:
        server.kill()


def test_a_tenants_reply_is_not_continued_from_another_tenants_gpu_slot(checkpoint_dir, tmp_path):
    """The prefix cache's GPU tier keeps a request's prompt and reply in its slot: another tenant that
    resends that history (a guess of the reply) must not adopt it, or cached_tokens would tell it
    that it guessed right."""
    with serving(checkpoint_dir("nemotron"), tmp_path, api_key=[ALICE, BOB], enable_prefix_caching=True, prefix_cache_min_tokens=1) as (srv, http):

        def tokens(text: str) -> list[int]:
            return http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}, headers=bearer(ALICE)).json()["tokens"]

        prompt = [5 + i % 50 for i in range(60)]
        letters = tokens("abcdefghij")  # a reply whose text encodes to the tokens generated
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "allowed_token_ids": letters}
        first = http.post("/v1/completions", json=body, headers=bearer(ALICE)).json()
        reply = tokens(first["choices"][0]["text"])
        resent = {**body, "prompt": prompt + reply + [9, 9]}

        def cached(key: str) -> int:
            r = http.post("/v1/completions", json=resent, headers=bearer(key))
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert len(reply) == 6 and cached(BOB) <= len(prompt)  # at most the prompt, from the host tier
        assert cached(ALICE) == len(prompt) + len(reply) - 1  # her own slot: prompt and reply
