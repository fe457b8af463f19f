"""The commands: `engram serve` (the default built-in model, as a process) and `engram chat`."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys

import httpx
import pytest
from server_utils import ServerProcess, free_port

from engram import cli, launch_server
from engram.models.builtin import resolve_model
from engram.models.embedded import ensure_embedded_model

SERVE_FLAGS = (
    "--model-path",
    "--host",
    "--port",
    "--served-model-name",
    "--dtype",
    "--max-running-requests",
    "--api-key",
    "--admin-api-key",
    "--log-level",
    "--max-num-batched-tokens",
    "--enable-cuda-graph",
    "--no-enable-cuda-graph",
)


@pytest.mark.parametrize("main", [lambda argv: cli.main(["serve", *argv]), launch_server.main], ids=["engram-serve", "launch_server"])
def test_serve_flags(main, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for flag in SERVE_FLAGS:
        assert flag in out, flag


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`python -m engram serve` without --model-path, as a separate process."""
    cache = tmp_path_factory.getbasetemp() / "engram-cache"
    ensure_embedded_model(cache)  # shared with the other server tests: generated once
    server = ServerProcess(
        ["--max-total-tokens", "4096", "--context-length", "512", "--max-running-requests", "2", "--log-level", "warning"],
        tmp_path_factory.mktemp("served") / "server.log",
        env={"ENGRAM_CACHE_DIR": str(cache)},
    )
    server.start()
    yield server.url, server.proc
    server.kill()


def test_serve_default_model(served):
    url, _ = served
    name = resolve_model(None).served_name
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [name]
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_chat_client(served, monkeypatch, capsys):
    url, _ = served
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nmore\n/reset\nagain\n/exit\n"))
    cli.main(["chat", "--url", url, "--max-tokens", "4", "--temperature", "0"])
    out = capsys.readouterr().out
    assert f"chatting with {resolve_model(None).served_name}" in out
    assert out.count("assistant> ") == 3 and "(conversation reset)" in out
    cached = [int(n) for n in re.findall(r"\((\d+) restored from saved state\)", out)]
    assert len(cached) == 3 and cached[0] == 0 and cached[1] > 0 and cached[2] == 0  # the second turn continues the first


def test_chat_client_reports_unreachable_server(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    with pytest.raises(SystemExit, match="cannot reach the server"):
        cli.main(["chat", "--url", f"http://127.0.0.1:{free_port()}"])


def test_serve_stops_cleanly_on_sigint(served):
    _, proc = served
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize("content", ["{not json", '{"quarantined": [{"ref": 1}]}'])
def test_an_unreadable_quarantine_list_stops_the_start_with_one_line(tmp_path_factory, tmp_path, content):
    """Not a traceback: one line naming the file and what to do, exit status 2."""
    cache = tmp_path_factory.getbasetemp() / "engram-cache"
    (tmp_path / "quarantine.json").write_text(content)
    cmd = [
        sys.executable,
        "-m",
        "engram",
        "serve",
        "--model-path",
        str(ensure_embedded_model(cache)),
        "--port",
        str(free_port()),
        "--snapshot-dir",
        str(tmp_path),
        "--max-total-tokens",
        "4096",
        "--context-length",
        "512",
        "--log-level",
        "warning",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert str(tmp_path / "quarantine.json") in lines[0] and "move it aside" in lines[0]


def test_a_model_path_without_a_checkpoint_stops_the_start_with_one_line(tmp_path):
    cmd = [sys.executable, "-m", "engram", "serve", "--model-path", str(tmp_path / "nothing"), "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip() == f"engram serve: no config.json at {tmp_path / 'nothing'}"


def test_a_negative_pinned_load_memory_stops_the_start_with_one_line_naming_the_flag():
    cmd = [sys.executable, "-m", "engram", "serve", "--pinned-load-memory-gb", "-1", "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert (
        "Traceback" not in done.stderr and done.stderr.strip() == "engram serve: --pinned-load-memory-gb must be 0 (none) or at least 4 KiB, got -1"
    )


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--snapshot-store", "ftp://host/x"], "the scheme is not one of"),
        (["--snapshot-store", "s3://b/p", "--snapshot-durability", "async"], "need --snapshot-durability sync"),
        (["--snapshot-store", "s3://b/p", "--no-enable-snapshot-persistence"], "snapshot persistence is off"),
    ],
)
def test_a_snapshot_store_the_server_cannot_use_stops_the_start_with_one_line(tmp_path_factory, flags, reason):
    cache = tmp_path_factory.getbasetemp() / "engram-cache"
    cmd = [
        sys.executable,
        "-m",
        "engram",
        "serve",
        "--model-path",
        str(ensure_embedded_model(cache)),
        "--port",
        str(free_port()),
        "--log-level",
        "warning",
        *flags,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if "Warning" not in line]
    assert "Traceback" not in done.stderr and len(lines) == 1 and reason in lines[0], done.stderr
