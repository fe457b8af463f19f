"""Scale-out end to end (issue 35): moto's S3 server, three `engram serve` replicas sharing it
(--snapshot-store s3://...), and nginx with deploy/nginx-engram.conf in front. Conversations move
to another replica when theirs is killed -9 and continue exactly from the store; two replicas
racing one turn record it once; an unreachable store is a 503 that loses no turn."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil

import httpx
import pytest
from fleet_utils import S3Server, start_nginx
from server_utils import ServerProcess, free_port

pytestmark = pytest.mark.scale_out
pytest.importorskip("moto.server", reason="needs moto[server]")
pytest.importorskip("obstore", reason="needs obstore (engram[s3])")
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)
if NGINX is None:
    pytest.skip("needs nginx (apt-get install nginx-light)", allow_module_level=True)

MODEL = "m"
BUCKET = "engram-fleet"


@pytest.fixture(scope="module")
def fleet(checkpoint_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fleet")
    store = S3Server()
    store.start()
    store.create_bucket(BUCKET)
    replicas = [
        ServerProcess(
            [
                "--model-path",
                checkpoint_dir("nemotron"),
                "--served-model-name",
                MODEL,
                "--snapshot-store",
                f"s3://{BUCKET}/fleet",
                "--snapshot-dir",
                str(folder / f"cache{i}"),
                "--no-enable-prefix-caching",
                "--max-total-tokens",
                "4096",
                "--context-length",
                "1024",
                "--log-level",
                "warning",
            ],
            folder / f"replica{i}.log",
            env={**store.env, "OMP_NUM_THREADS": "1"},
        )
        for i in range(3)
    ]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda r: r.start(), replicas))
    port = free_port()
    nginx = start_nginx(NGINX, folder, port, replicas)
    router = f"http://127.0.0.1:{port}"
    try:
        yield router, replicas, store
    finally:
        nginx.kill()
        nginx.wait()
        for r in replicas:
            r.kill()
        with contextlib.suppress(Exception):
            store.stop()


def turn(http: httpx.Client, conversation_id: str, text: str, key: str, max_tokens: int = 6, url: str = "") -> httpx.Response:
    """One turn through the router (or `url`, a replica): greedy, with the routing header and an Idempotency-Key."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "conversation_id": conversation_id,
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    return http.post(url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conversation_id, "Idempotency-Key": key})


def latest_snapshot(http: httpx.Client, conversation_id: str) -> dict:
    r = http.post("/get_snapshot_info", json={"conversation_id": conversation_id}, headers={"X-Conversation-Id": conversation_id})
    assert r.status_code == 200, r.text
    return r.json()


def as_stored(conversation: dict) -> dict:
    """A conversation as GET /v1/conversations/{id} answers it, less what is the answering
    replica's own: its epoch and the tier each turn's state is in there."""
    turns = [{k: v for k, v in t.items() if k != "tier"} for t in conversation["turns"]]
    return {**{k: v for k, v in conversation.items() if k != "epoch"}, "turns": turns}


def check_exact(http: httpx.Client, conversation_id: str, reply: dict, before: dict | None) -> None:
    """The turn's reply equals one /generate over its whole prompt, and it started from the state
    the store held after the previous turn (cached tokens)."""
    after = latest_snapshot(http, conversation_id)
    prompt = after["fill_ids"][: len(after["fill_ids"]) - reply["usage"]["completion_tokens"]]
    full = http.post("/generate", json={"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6}})
    assert full.json()["output_ids"] == after["fill_ids"][len(prompt) :]
    if before is not None:
        assert prompt[: len(before["fill_ids"])] == before["fill_ids"]
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == before["state_len"] > 0


def test_conversations_move_to_another_replica_when_theirs_is_killed(fleet):
    router, replicas, _ = fleet
    by_address = {f"127.0.0.1:{r.port}": r for r in replicas}
    served: dict[str, list[str]] = {f"conv{i}": [] for i in range(20)}
    victim = None
    with httpx.Client(base_url=router, timeout=60) as http:
        for round_ in range(1, 5):
            for n, cid in enumerate(served):
                if round_ == 3 and n == 10:  # in the middle: the replica that served the most so far
                    victim = max(replicas, key=lambda r: sum(by_address[a[-1]] is r for a in served.values() if a))
                    victim.kill()
                moves = victim is not None and by_address[served[cid][-1]] is victim
                before = latest_snapshot(http, cid) if moves else None  # read through the router: from the store
                r = turn(http, cid, f"message {round_} of {cid}", key=f"{cid}-{round_}")
                assert r.status_code == 200, r.text
                assert r.json()["turn"] == round_
                served[cid].append(r.headers["X-Engram-Upstream"].split(", ")[-1])
                if moves:  # restored from the store on another replica, and exact
                    assert by_address[served[cid][-1]] is not victim
                    check_exact(http, cid, r.json(), before)
        moved = [cid for cid, addrs in served.items() if by_address[addrs[1]] is victim]
        assert moved, "no conversation was on the killed replica"
        for cid in moved[:3]:  # and after the move: the new replica goes on with what it holds
            check_exact(http, cid, turn(http, cid, "one more", key=f"{cid}-5").json(), None)
        survivors = [r for r in replicas if r is not victim]
        for cid in served:  # no turn lost or answered twice, and every replica says so
            views = [as_stored(http.get(f"{r.url}/v1/conversations/{cid}").json()) for r in survivors]
            assert views[0] == views[1]
            assert views[0]["branches"]["main"]["latest_turn"] == (5 if cid in moved[:3] else 4)
        victim.start()  # it comes back with an empty memory and answers from what the store holds
        assert as_stored(http.get(f"{victim.url}/v1/conversations/{cid}").json()) == views[0]


def test_two_replicas_racing_one_turn_exactly_one_records_it(fleet):
    router, replicas, _ = fleet
    a, b = [r for r in replicas if r.proc.poll() is None][:2]
    with httpx.Client(timeout=60) as http:
        assert turn(http, "race", "first", key="race-1", url=a.url).status_code == 200
        assert turn(http, "race", "second", key="race-2", url=b.url).status_code == 200  # both hold turn 2 now
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            tries = [pool.submit(turn, http, "race", f"third from {r.port}", f"race-3-{r.port}", 48, r.url) for r in (a, b)]
            answers = [t.result() for t in tries]
        assert sorted(r.status_code for r in answers) == [200, 409], [r.text for r in answers]
        loser = (a, b)[[r.status_code for r in answers].index(409)]
        assert answers[[r.status_code for r in answers].index(409)].json()["error"]["code"] == "stale_view"
        again = turn(http, "race", "fourth", key="race-4", url=loser.url)  # the loser reads the conversation afresh
        assert again.status_code == 200 and again.json()["turn"] == 4
        record = as_stored(http.get(f"{a.url}/v1/conversations/race").json())
        assert record == as_stored(http.get(f"{b.url}/v1/conversations/race").json())
        assert record["branches"]["main"]["latest_turn"] == 4


def test_an_unreachable_store_is_a_503_naming_it_and_loses_no_turn(fleet):
    router, _, store = fleet
    with httpx.Client(base_url=router, timeout=60) as http:
        assert turn(http, "down", "hello", key="down-1").status_code == 200
        store.stop()
        try:
            r = turn(http, "down", "while the store is down", key="down-2")
        finally:
            store.start()
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "storage_unavailable" and f"s3://{BUCKET}/fleet" in r.json()["error"]["message"]
        again = turn(http, "down", "while the store is down", key="down-2")
        assert again.status_code == 200 and again.json()["turn"] == 2
        check_exact(http, "down", again.json(), None)
