"""MIGRATING.md, run: the server started with the predecessor's quick-start command, then every
`curl` block and every Python block of the page in order, as written (the test's port and
checkpoint in place of `localhost:30000` and `MODEL_PATH`)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engram.runtime import free_port, wait_until_healthy

PAGE = Path(__file__).resolve().parents[1] / "MIGRATING.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
QUICK_START = (
    "python -m engram.launch_server --model-path ./granite-4.0-h-tiny --enable-snapshot-persistence "
    "--snapshot-dir ./snapshots --mamba-scheduler-strategy no_buffer --port 30000"
)
CURL = 'curl() { command curl -sS --fail-with-body "$@"; }\n'  # a 4xx or 5xx fails the block


def blocks() -> list[tuple[str, str]]:
    return [(kind, body) for kind, body in BLOCK.findall(PAGE.read_text())]


@pytest.fixture(scope="module")
def quick_start(checkpoint_dir, tmp_path_factory):
    """The page's command, run as it is written in a folder holding the checkpoint under that name."""
    assert ("sh", QUICK_START + "\n") in blocks()
    work = tmp_path_factory.mktemp("migrating")
    shutil.copytree(checkpoint_dir("nemotron"), work / "granite-4.0-h-tiny")
    port = free_port()
    argv = shlex.split(QUICK_START.replace("--port 30000", f"--port {port}"))
    process = subprocess.Popen([sys.executable, *argv[1:]], cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", process, 120)
        yield work, port
    finally:
        process.kill()
        process.wait()


def localize(text: str, port: int, model: Path) -> str:
    text = text.replace("localhost:30000", f"127.0.0.1:{port}")
    return text.replace('MODEL_PATH = "ibm-granite/granite-4.0-h-tiny"', f"MODEL_PATH = {str(model)!r}")


def test_every_example_of_the_page_runs(quick_start):
    work, port = quick_start
    model = work / "granite-4.0-h-tiny"
    env = {**os.environ, "SGLANG_ADMIN_KEY": "unused-here"}
    ran = []
    for kind, body in blocks():
        code = localize(body, port, model)
        if kind == "bash" and body.startswith("curl"):
            done = subprocess.run(["bash", "-c", CURL + code], cwd=work, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, (body, done.stdout, done.stderr)
            answer = json.loads(done.stdout)
            assert answer.get("success", True) is True, answer
        elif kind == "python":
            done = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, (body, done.stdout, done.stderr)
        else:
            continue
        ran.append((body.split("\n")[0], done.stdout))
    assert len(ran) == 15  # 12 curl commands, 3 Python snippets
    outputs = dict(ran)
    assert outputs["import requests"].strip() not in ("", "None")  # the predecessor's restore-and-generate printed text
    assert "Turn 2: " in outputs["from engram.client import SnapshotManager"]
    assert "Snapshot has " in outputs["import engram"]

    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
        main = http.get("/v1/conversations/session-1").json()["branches"]["main"]
        assert main["latest_turn"] == 2
        forked = http.get("/v1/conversations/session-2").json()["branches"]["main"]["messages"]
        assert forked[:2] == main["messages"][:2] and forked[2]["content"] == "And my favorite number?"
