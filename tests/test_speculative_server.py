"""Speculative decoding behind the server: conversation turns across a restart and prefix-cache hits
answer as a server without speculation does; /metrics counts drafts; a bad config stops the start.

A random model's output rarely repeats, so prompt lookup's drafts are almost never kept: the
servers here draft transformers' greedy continuation, right in part (`ReferenceDrafter(mixed=True)`),
so that some drafts are kept and some rolled back."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import httpx
import pytest
from engine_utils import ReferenceDrafter
from server_utils import free_port, metric_value, running_server

from engram.engine import speculative

MODEL = "m"
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
TURNS = ["abcabcabcabc abc", "xyz xyz xyz abcabc", "once more: abcabc"]


@contextlib.contextmanager
def serving(path, snapshot_dir, spec: bool, **fields):
    engine = {"speculative_config": NGRAM} if spec else {}
    with running_server(path, MODEL, engine, snapshot_dir=str(snapshot_dir), **fields) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        yield http


def turn(http, text):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "conversation_id": "c",
        "temperature": 0,
        "max_tokens": 24,
        "ignore_eos": True,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def complete(http, prompt):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 16})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("arch", ["granite", "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2"])  # Mamba2, gated DeltaNet, short conv
def test_turns_across_a_restart_and_prefix_hits_answer_as_without_speculation(arch, checkpoint_dir, hf_model, tmp_path, monkeypatch):
    path = checkpoint_dir(arch)
    monkeypatch.setattr(speculative, "NgramDrafter", lambda *lookup: ReferenceDrafter(hf_model(path), mixed=True))
    prompt = "copy this: 1 2 3 1 2 3 1 2 3"
    cache = dict(enable_prefix_caching=True, prefix_cache_min_tokens=1)
    with serving(path, tmp_path / "plain", spec=False, **cache) as http:
        plain = [turn(http, t)[0] for t in TURNS]
        plain_completions = [complete(http, prompt)[0], complete(http, prompt + " 1 2")[0]]

    with serving(path, tmp_path / "spec", spec=True, **cache) as http:
        got = [turn(http, t)[0] for t in TURNS[:2]]
        assert metric_value(http.get("/metrics").text, "engram:spec_decode_num_draft_tokens_total", model_name=MODEL) > 0
        first, _ = complete(http, prompt)
        second, cached = complete(http, prompt + " 1 2")
        metrics = http.get("/metrics").text
    assert [first, second] == plain_completions and cached > 0  # the second started from the first's prompt state
    drafts = metric_value(metrics, "engram:spec_decode_num_draft_tokens_total", model_name=MODEL)
    accepted = metric_value(metrics, "engram:spec_decode_num_accepted_tokens_total", model_name=MODEL)
    per_position = [
        metric_value(metrics, "engram:spec_decode_num_accepted_tokens_per_pos_total", model_name=MODEL, position=str(i)) for i in range(3)
    ]
    assert drafts > 0 and 0 < accepted < drafts and sum(per_position) == accepted  # some drafts kept, some rolled back

    with serving(path, tmp_path / "spec", spec=True, **cache) as http:  # a restart: the third turn resumes the stored state
        text, cached = turn(http, TURNS[2])
        got.append(text)
    assert got == plain and cached > 0


def test_a_bad_speculative_config_stops_the_start_with_one_line(tmp_path, checkpoint_dir):
    cmd = [
        sys.executable,
        "-m",
        "engram",
        "serve",
        "--model-path",
        checkpoint_dir("mamba2"),
        "--port",
        str(free_port()),
        "--snapshot-dir",
        str(tmp_path),
        "--speculative-config",
        '{"method": "mtp", "num_speculative_tokens": 2}',
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert "method 'mtp' needs a checkpoint with MTP layers" in lines[0]
