"""kill -9 of a serving process mid-conversation: every listed snapshot still loads, and with sync
durability every answered turn is resumable, exactly."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
from server_utils import ServerProcess

MODEL = "m"


def serve_args(model_path: str, snapshot_dir, *flags: str) -> list[str]:
    """`engram serve` of `model_path` as MODEL with sync durability, short contexts, quiet logs."""
    return [
        "--model-path",
        str(model_path),
        "--served-model-name",
        MODEL,
        "--snapshot-dir",
        str(snapshot_dir),
        "--snapshot-durability",
        "sync",
        "--max-total-tokens",
        "4096",
        "--context-length",
        "1024",
        "--log-level",
        "warning",
        *flags,
    ]


def chat(http, conversation_id, text):
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "conversation_id": conversation_id, "temperature": 0, "max_tokens": 8}
    r = http.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_kill_9_mid_conversations_then_everything_answered_is_resumable(checkpoint_dir, tmp_path):
    path = checkpoint_dir("nemotron")
    server = ServerProcess(serve_args(path, tmp_path / "snapshots"), tmp_path / "server.log")
    server.start()
    answered: dict[str, int] = {}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            killer = None
            for i in range(40):
                conv = f"c{i % 4}"
                if i == 9:  # kill while the tenth turn is being served
                    killer = threading.Timer(0.05 + (os.getpid() % 7) / 100, os.kill, (server.pid, signal.SIGKILL))
                    killer.start()
                try:
                    answered[conv] = chat(http, conv, f"message {i}")["turn"]
                except httpx.HTTPError:
                    break
            if killer is not None:
                killer.join()
    finally:
        server.kill()
    assert sum(answered.values()) >= 9

    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for snap in http.post("/list_snapshots", json={}).json()["snapshots"]:
                r = http.post("/restore_snapshot", json={"conversation_id": snap["conversation_id"], "turn_number": snap["turn_number"]})
                assert r.status_code == 200, r.text
            for conv, turn in answered.items():
                assert http.get(f"/v1/conversations/{conv}").json()["branches"]["main"]["latest_turn"] >= turn
                info = http.post("/get_snapshot_info", json={"conversation_id": conv}).json()
                reply = chat(http, conv, "after the crash")
                new_info = http.post("/get_snapshot_info", json={"conversation_id": conv}).json()
                prompt = new_info["fill_ids"][: len(new_info["fill_ids"]) - reply["usage"]["completion_tokens"]]
                assert prompt[: len(info["fill_ids"])] == info["fill_ids"]
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == info["state_len"]
                full = http.post("/generate", json={"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}).json()
                assert full["output_ids"] == new_info["fill_ids"][len(prompt) :]
    finally:
        server.kill()


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs POSIX signals")
def test_sigterm_writes_the_states_only_memory_holds(checkpoint_dir, tmp_path):
    """No snapshot by the trigger policy yet: a graceful shutdown writes the states, so the turn
    after the restart restores them (cached tokens) and equals an uninterrupted conversation's."""
    path = checkpoint_dir("nemotron")
    policy = ("--snapshot-trigger-policy", "every_n_turns", "--snapshot-every-n-turns", "100")
    server = ServerProcess(serve_args(path, tmp_path / "snapshots", *policy), tmp_path / "server.log")
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for text in ("one", "two"):
                chat(http, "t", text)
            for text in ("one", "two", "three"):
                uninterrupted = chat(http, "u", text)
            assert http.post("/list_snapshots", json={}).json()["snapshots"] == []
        server.stop(signal.SIGTERM)  # uvicorn shuts down, then raises the signal again: -SIGTERM either way
    finally:
        server.kill()

    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            info = http.post("/get_snapshot_info", json={"conversation_id": "t", "turn_number": 2}).json()
            reply = chat(http, "t", "three")
        assert reply["turn"] == 3 and info["state_len"] > 0
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == info["state_len"]
        assert reply["choices"][0]["message"]["content"] == uninterrupted["choices"][0]["message"]["content"]
        assert reply["usage"]["completion_tokens"] == uninterrupted["usage"]["completion_tokens"]
    finally:
        server.kill()
