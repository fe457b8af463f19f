"""Start-up: /health waits for the warm-up, the banner, the metrics' labels and new counters."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_utils import metric_value, running_server

from engram.args import EngineArgs, ServerArgs
from engram.engine import warmup
from engram.engine.engine import LLMEngine
from engram.launch_server import build_app
from engram.server.background import BackgroundServer
from engram.server.startup import banner

MODEL = "m"


def test_health_is_503_while_warming_then_200(checkpoint_dir, monkeypatch):
    release = threading.Event()
    warm_up = LLMEngine.warm_up
    monkeypatch.setattr(LLMEngine, "warm_up", lambda self, on_stage=None: (release.wait(30), warm_up(self, on_stage))[1])
    app = build_app(EngineArgs(model_path=checkpoint_dir("mamba2"), max_total_tokens=4096, context_length=512), ServerArgs(served_model_name=MODEL))
    with BackgroundServer(app, wait_ready=False) as srv:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "warming", r.text
        release.set()
        deadline = time.monotonic() + 30
        while (r := httpx.get(srv.url + "/health")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.status_code == 200
        assert app.state.serving.startup.status == "ready"


def test_a_failed_warm_up_keeps_the_server_unready(checkpoint_dir, monkeypatch):
    def fail(self, on_stage=None):
        raise RuntimeError("no kernels")

    monkeypatch.setattr(LLMEngine, "warm_up", fail)
    app = build_app(EngineArgs(model_path=checkpoint_dir("mamba2"), max_total_tokens=4096, context_length=512), ServerArgs(served_model_name=MODEL))
    with BackgroundServer(app) as srv:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "failed" and "no kernels" in r.json()["stage"]


def test_the_banner_names_what_the_server_runs_with(checkpoint_dir, tmp_path):
    path = checkpoint_dir("granite")
    args = ServerArgs(served_model_name=MODEL, snapshot_dir=str(tmp_path), snapshot_trigger_policy="every_n_turns")
    app = build_app(EngineArgs(model_path=path, max_total_tokens=4096, context_length=512, max_running_requests=3), args)
    text = banner(app.state.serving, args, "http://127.0.0.1:1234")
    for expected in (
        path,
        "GraniteMoeHybridForCausalLM",
        "float32",
        "cpu",
        "torch-reference",
        "CUDA graphs off",
        "x 3 running",
        "KV 4,096 tokens",
        "context length 512",
        "max running requests 3",
        str(tmp_path),
        "every_n_turns",
        "durability sync",
        "WARM host memory",
        "encoded past the last added token",
        "memory allocated for each load",  # no arena: the CPU's loads stage nothing
        "http://127.0.0.1:1234",
    ):
        assert expected in text, expected


def _series(text: str, name: str, **labels: str) -> float:
    return metric_value(text, name, model_name=MODEL, **labels)


def test_every_series_has_the_model_name_and_restored_tokens_are_counted(checkpoint_dir, tmp_path):
    with running_server(checkpoint_dir("mamba2"), MODEL, snapshot_dir=str(tmp_path)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "conversation_id": "c", "max_tokens": 4, "temperature": 0}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        before = http.get("/metrics").text
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        after = http.get("/metrics").text
    samples = [line for line in after.splitlines() if line and not line.startswith("#")]
    assert samples and all(f'model_name="{MODEL}"' in line for line in samples), [s for s in samples if "model_name" not in s][:3]
    restored = _series(after, "engram:prompt_tokens_by_source_total", source="restored") - _series(
        before, "engram:prompt_tokens_by_source_total", source="restored"
    )
    computed = _series(after, "engram:prompt_tokens_by_source_total", source="computed") - _series(
        before, "engram:prompt_tokens_by_source_total", source="computed"
    )
    assert restored > 0 and computed > 0  # the second turn restored the first's state, computed its own tokens
    for name in ("engram:num_preemptions_total", "engram:graph_captures_total", "engram:compilations_after_ready_total"):
        assert _series(after, name) == 0, name


def test_compilations_after_ready_are_counted(checkpoint_dir):
    engine = LLMEngine(EngineArgs(model_path=checkpoint_dir("mamba2"), max_total_tokens=4096, context_length=512))
    warmup._count_compilation()  # as Triton's hook does (before ready)
    engine.mark_ready()
    assert engine.stats().compilations_after_ready == 0
    warmup._count_compilation()
    engine.runner.num_graph_captures += 1  # as a capture on a request's path does
    assert engine.stats().compilations_after_ready == 2


def test_the_warm_up_is_not_traffic(checkpoint_dir, monkeypatch):
    """Its requests leave the token counters and the default generator as they were."""
    engine = LLMEngine(EngineArgs(model_path=checkpoint_dir("mamba2"), max_total_tokens=4096, context_length=512))
    stages = [warmup.WarmupStage("requests", lambda: warmup._run(engine, [([1, 2, 3], p) for p in warmup.SAMPLER_PATHS]))]
    monkeypatch.setattr(warmup, "warmup_stages", lambda _: stages)
    before, draw = engine.stats(), engine._default_generator.get_state()
    seen = []
    report = engine.warm_up(lambda name, i, n: seen.append((name, i, n)))
    assert seen == [("requests", 1, 1)] and report.stages == ["requests"]
    assert engine.stats() == before
    assert engine._default_generator.get_state().equal(draw)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("chunk, limit, expected_max", [(2048, 10_000, 3072), (2048, 1000, 528), (64, 10_000, 96)])
def test_prefill_lengths_cover_the_specializations(chunk, limit, expected_max):
    lengths = warmup.prefill_lengths(chunk, limit)
    assert max(lengths) == expected_max and all(0 < n < limit for n in lengths)
    assert {16, 17, 32, 33} <= set(lengths)  # divisible by 16 or not, around each power of two
