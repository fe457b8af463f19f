"""A drop-in for the SGLang-based predecessor's users: its flags, cross-session references, and
`engram.Runtime` with its `SnapshotManager` call signatures."""

from __future__ import annotations

import argparse
import contextlib
import shutil

import httpx
import pytest
from server_utils import running_server

import engram
from engram.args import REFUSED_FLAGS
from engram.launch_server import add_server_args
from engram.runtime import server_argv

MODEL = "m"
GREEDY = {"temperature": 0, "max_tokens": 6}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(argv)


def test_the_predecessors_accepted_flags_parse_and_map():
    ns = parse(
        [
            "--enable-snapshot-persistence",
            "--snapshot-dir",
            "./snapshots",
            "--mamba-scheduler-strategy",
            "no_buffer",
            "--mamba-radix-cache-strategy",
            "extra_buffer_lazy",
            "--trust-remote-code",
            "--enable-cross-session-refs",
            "--conversation-cold-retention",
            "604800",
            "--max-warm-conversations",
            "100",
            "--snapshot-retention-count",
            "10",
            "--snapshot-health-check-interval",
            "0",
            "--snapshot-health-failure-policy",
            "skip_snapshot",
        ]
    )
    assert (ns.snapshot_dir, ns.conversation_cold_retention, ns.snapshot_retention_count) == ("./snapshots", 604800.0, 10)
    assert ns.enable_cross_session_refs and ns.enable_prefix_caching
    from engram.args import apply_predecessor_args

    radix_off = parse(["--disable-radix-cache"])
    apply_predecessor_args(radix_off)
    assert radix_off.enable_prefix_caching is False


def test_help_says_what_the_strategies_map_to(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--mamba-scheduler-strategy", "--mamba-radix-cache-strategy", "--enable-cross-session-refs", "--disable-radix-cache"):
        assert flag in out
    assert "restored exactly under every value" in out and "--enable-prefix-caching" in out


@pytest.mark.parametrize("argv", [["--snapshot-auto-restore"], ["--tier-cleanup-interval", "60"], ["--no-snapshot-keep-named-branches"]])
def test_the_predecessors_flags_without_a_counterpart_are_refused_with_what_to_use(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    name = argv[0].removeprefix("--no-").removeprefix("--").replace("-", "_")
    assert argv[0] in err and REFUSED_FLAGS[name] in err


def test_runtime_keywords_become_flags():
    assert server_argv(model_path="/m", enable_snapshot_persistence=True, enable_cuda_graph=False, api_key=["a", "b"], port=1) == [
        "--model-path",
        "/m",
        "--enable-snapshot-persistence",
        "--no-enable-cuda-graph",
        "--api-key",
        "a",
        "--api-key",
        "b",
        "--port",
        "1",
    ]
    with pytest.raises(TypeError, match="enable_snapshots"):
        engram.Runtime(enable_snapshots=True)
    with pytest.raises(ValueError, match="--snapshot-preload"):
        engram.Runtime(snapshot_auto_restore=True)


@contextlib.contextmanager
def serving(path: str, snapshot_dir, **fields):
    with running_server(path, MODEL, snapshot_dir=str(snapshot_dir), **fields) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        yield http


def chat(http, conversation_id, text, headers=None, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "conversation_id": conversation_id, **GREEDY, **fields}
    return http.post("/v1/chat/completions", json=body, headers=headers)


def fill_ids(http, conversation_id, turn, headers=None):
    r = http.post("/get_snapshot_info", json={"conversation_id": conversation_id, "turn_number": turn}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["fill_ids"]


def test_a_conversation_started_from_anothers_turn_continues_it_exactly(checkpoint_dir, tmp_path):
    with serving(checkpoint_dir("nemotron"), tmp_path) as http:
        assert chat(http, "src", "Hello there, how are you?").status_code == 200
        assert chat(http, "src", "Tell me about state space models.").status_code == 200
        forked = chat(http, "copy", "And what about attention?", from_conversation="src", from_turn=1)
        assert forked.status_code == 200, forked.text
        body = forked.json()
        assert (body["conversation_id"], body["turn"]) == ("copy", 1)
        source = fill_ids(http, "src", 1)
        tokens = fill_ids(http, "copy", 1)
        assert tokens[: len(source)] == source  # the source's turn 1, not its turn 2
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(source) - 1  # its state, not recomputed
        # the reply equals a full prefill of the same tokens
        reply = len(tokens) - body["usage"]["prompt_tokens"]
        reference = http.post("/generate", json={"input_ids": tokens[:-reply], "sampling_params": {"temperature": 0, "max_new_tokens": reply}}).json()
        assert reference["meta_info"]["cached_tokens"] == 0 and reference["output_ids"] == tokens[-reply:]
        # it stands on its own: deleting the source leaves it whole, and it goes on
        assert http.delete("/v1/conversations/src").status_code == 200
        assert [m["role"] for m in http.get("/v1/conversations/copy").json()["branches"]["main"]["messages"]] == ["user", "assistant"] * 2
        assert chat(http, "copy", "Thanks.").json()["turn"] == 2

        assert chat(http, "copy", "x", from_conversation="missing").status_code == 409  # copy has turns already
        missing = chat(http, "new", "x", from_conversation="missing")
        assert missing.status_code == 404 and "missing" in missing.text
        no_id = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "from_conversation": "copy"})
        assert no_id.status_code == 400 and "from_conversation" in no_id.text


def test_cross_session_refs_are_owner_checked_and_can_be_turned_off(checkpoint_dir, tmp_path):
    alice, bob = {"Authorization": "Bearer alice-key"}, {"Authorization": "Bearer bob-key"}
    with serving(checkpoint_dir("nemotron"), tmp_path / "a", api_key=["alice-key", "bob-key"]) as http:
        assert chat(http, "hers", "Hello", headers=alice).status_code == 200
        theft = chat(http, "his", "Hello", headers=bob, from_conversation="hers")
        assert theft.status_code == 404 and "hers" in theft.text
        assert http.get("/v1/conversations/his", headers=bob).status_code == 404  # nothing was made
        assert chat(http, "hers-too", "Hello", headers=alice, from_conversation="hers").status_code == 200
    with serving(checkpoint_dir("nemotron"), tmp_path / "b", enable_cross_session_refs=False) as http:
        assert chat(http, "src", "Hello").status_code == 200
        off = chat(http, "copy", "Hello", from_conversation="src")
        assert off.status_code == 400 and "--enable-cross-session-refs" in off.json()["error"]["message"]
        assert off.json()["error"]["param"] == "from_conversation"


def test_runtime_and_snapshot_manager_with_the_predecessors_signatures(checkpoint_dir, tmp_path):
    model = shutil.copytree(checkpoint_dir("nemotron"), tmp_path / "model")
    with engram.Runtime(
        model_path=str(model),
        enable_snapshot_persistence=True,
        snapshot_dir=str(tmp_path / "snaps"),
        enable_prefix_caching=False,
        max_total_tokens=4096,
        context_length=1024,
        log_level="warning",
    ) as runtime:
        conv = runtime.endpoint.conversation("conv_123", **GREEDY)
        for text in ("Hello there, how are you?", "Tell me about state space models.", "And what about attention?"):
            conv.chat(text)
        sm = engram.SnapshotManager(runtime.endpoint)
        listed = sm.list_conversation("conv_123")
        assert [s["turn_number"] for s in listed] == [1, 2, 3]
        assert all(s["model_name"] == "model" and s["timestamp"] > 0 for s in listed)
        info = sm.get_info("conv_123", turn_number=2)
        assert info["token_count"] == len(info["fill_ids"]) == listed[1]["token_count"] < listed[2]["token_count"]

        restored = sm.restore(rid="req_123", conversation_id="conv_123", turn_number=2)
        assert restored["success"] and restored["token_count"] == info["token_count"]
        more = [65, 66, 67]
        generated = sm.restore(
            conversation_id="conv_123",
            turn_number=2,
            create_new_request=True,
            continuation_ids=more,
            max_new_tokens=5,
            sampling_params={"temperature": 0},
        )
        reference = runtime.endpoint.generate(input_ids=info["fill_ids"] + more, sampling_params={"temperature": 0, "max_new_tokens": 5})
        assert generated["meta_info"]["cached_tokens"] == info["state_len"] and reference["meta_info"]["cached_tokens"] == 0
        assert generated["output_ids"] == reference["output_ids"] and generated["output_text"] == reference["text"]

        assert sm.delete("conv_123", turn_number=3) is True
        assert sm.delete("conv_123", turn_number=3) is False
        assert [s["turn_number"] for s in sm.list_conversation("conv_123")] == [1, 2]
        with pytest.raises(RuntimeError, match="no turn 9"):
            sm.get_info("conv_123", turn_number=9)
        process = runtime.process
    assert process.returncode is not None  # shut down on leaving the `with`
