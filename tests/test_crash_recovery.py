"""kill -9 of a serving process mid-conversation: every listed snapshot still loads, and with sync
durability every answered turn is resumable, exactly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

MODEL = "m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_path: str, snapshot_dir, port: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engram", "serve", "--model-path", model_path, "--port", str(port),
           "--served-model-name", MODEL, "--snapshot-dir", str(snapshot_dir), "--snapshot-durability", "sync",
           "--max-total-tokens", "4096", "--context-length", "1024", "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode())
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def chat(http, conversation_id, text):
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "conversation_id": conversation_id,
            "temperature": 0, "max_tokens": 8}
    r = http.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_kill_9_mid_conversations_then_everything_answered_is_resumable(checkpoint_dir, tmp_path):
    path = checkpoint_dir("nemotron")
    port = free_port()
    proc = start_server(path, tmp_path, port)
    answered: dict[str, int] = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            killer = None
            for i in range(40):
                conv = f"c{i % 4}"
                if i == 9:  # kill while the tenth turn is being served
                    killer = threading.Timer(0.05 + (os.getpid() % 7) / 100, os.kill, (proc.pid, signal.SIGKILL))
                    killer.start()
                try:
                    answered[conv] = chat(http, conv, f"message {i}")["turn"]
                except httpx.HTTPError:
                    break
            if killer is not None:
                killer.join()
    finally:
        proc.kill()
        proc.wait()
    assert sum(answered.values()) >= 9

    port = free_port()
    proc = start_server(path, tmp_path, port)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
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
                assert full["output_ids"] == new_info["fill_ids"][len(prompt):]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs POSIX signals")
def test_sigterm_writes_the_states_only_memory_holds(checkpoint_dir, tmp_path):
    """No snapshot by the trigger policy yet: a graceful shutdown writes the states, so the turn
    after the restart restores them (cached tokens) and equals an uninterrupted conversation's."""
    path = checkpoint_dir("nemotron")
    policy = ("--snapshot-trigger-policy", "every_n_turns", "--snapshot-every-n-turns", "100")
    proc = start_server(path, tmp_path, port := free_port(), *policy)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            for text in ("one", "two"):
                chat(http, "t", text)
            for text in ("one", "two", "three"):
                uninterrupted = chat(http, "u", text)
            assert http.post("/list_snapshots", json={}).json()["snapshots"] == []
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)  # uvicorn shuts down, then raises the signal again: -SIGTERM either way
    finally:
        proc.kill()
        proc.wait()

    proc = start_server(path, tmp_path, port := free_port(), *policy)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            info = http.post("/get_snapshot_info", json={"conversation_id": "t", "turn_number": 2}).json()
            reply = chat(http, "t", "three")
        assert reply["turn"] == 3 and info["state_len"] > 0
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == info["state_len"]
        assert reply["choices"][0]["message"]["content"] == uninterrupted["choices"][0]["message"]["content"]
        assert reply["usage"]["completion_tokens"] == uninterrupted["usage"]["completion_tokens"]
    finally:
        proc.kill()
        proc.wait()
