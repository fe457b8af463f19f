"""`engram import-snapshots`: a folder in the predecessor's layout, written here from the format's
description with states transformers computes, imported by MIGRATING.md's command; then a server
continues each conversation as one /generate over its token ids would."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from server_utils import ServerProcess

from engram.models.spec import load_model_spec

KIND = "granite"  # hybrid: its attention KV is not in the predecessor's files, the import computes it
PAGE = Path(__file__).resolve().parents[1] / "MIGRATING.md"
COMMAND = re.search(r"^```sh\n(engram import-snapshots .*)\n```", PAGE.read_text(), re.MULTILINE).group(1)
SOURCE, STORE, REPORT = "./sglang_snapshots", "./snapshots", "import-report.json"


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


HISTORY_1 = tokens(1, 21)
HISTORY_2 = HISTORY_1 + tokens(2, 13)
BRANCH = HISTORY_1 + tokens(3, 9)
OTHER = tokens(4, 30)
WRONG = tokens(6, 30)  # its own tokens: the store is content-addressed, a state of tokens another conversation has is shared
CONTINUATION = tokens(5, 5)


def predecessor_state(model, spec, ids: list[int]) -> dict[str, torch.Tensor]:
    """The predecessor's tensors after `ids`, from transformers: its pool rows of every Mamba layer,
    conv state [conv_dim, kernel - 1] (transformers keeps the whole kernel window)."""
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    layers = [cache.layers[i] for i in spec.mamba_layers]  # each one's states by number, batch first
    return {
        "temporal": torch.stack([layer.recurrent_states[0][0] for layer in layers]).contiguous(),
        "conv_layer_0": torch.stack([layer.conv_states[0][0, :, 1:] for layer in layers]).contiguous(),
    }


def write_turn(folder: Path, cid: str, number: int, fill_ids: list[int] | None, state: dict | None, branch: str | None = None, **fields) -> Path:
    """One saved turn as the predecessor wrote it (its MambaSnapshotMetadata fields)."""
    meta = {
        "conversation_id": cid,
        "turn_number": number,
        "timestamp": 1.7e9,
        "token_count": len(fill_ids or []),
        "model_name": "ibm-granite/granite-4.0-h-tiny",
        "mamba_pool_idx": 1,
        "req_pool_idx": 0,
        "layer_config": {"num_layers": 2, "model_type": "hybrid"},
        "active_tool_context": None,
        "branch_name": branch,
        "parent_snapshot": None,
        "fill_ids": fill_ids,
        **fields,
    }
    conv_dir = folder / f"conversation_{cid}"
    base = conv_dir / "branches" / branch if branch else conv_dir / f"turn_{number}"
    base.parent.mkdir(parents=True, exist_ok=True)
    (base.parent / f"{base.name}_metadata.json").write_text(json.dumps(meta, indent=2))
    if state is not None:
        save_file(state, base.parent / f"{base.name}_state.safetensors")
    return base.parent / f"{base.name}_state.safetensors"


@pytest.fixture(scope="module")
def work(checkpoint_dir, hf_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("import")
    model_dir = work / "granite-4.0-h-tiny"
    shutil.copytree(checkpoint_dir(KIND), model_dir)
    model, spec = hf_model(checkpoint_dir(KIND)), load_model_spec(model_dir)
    src = work / SOURCE
    write_turn(src, "alpha", 0, HISTORY_1, predecessor_state(model, spec, HISTORY_1))
    write_turn(src, "alpha", 1, HISTORY_2, predecessor_state(model, spec, HISTORY_2))
    write_turn(src, "alpha", 1, BRANCH, predecessor_state(model, spec, BRANCH), branch="what-if")
    write_turn(src, "wrong", 0, WRONG, predecessor_state(model, spec, HISTORY_1))  # the state of other tokens
    write_turn(src, "stateless", 0, OTHER, None)
    good = predecessor_state(model, spec, OTHER)
    write_turn(src, "shape", 0, OTHER, {**good, "temporal": torch.zeros(2, 4, 24, 16)})  # another d_state
    write_turn(src, "no-ids", 0, None, good)
    state = write_turn(src, "torn", 0, OTHER, good)
    state.write_bytes(state.read_bytes()[:-100])
    write_turn(src, ".hidden", 0, OTHER, good)
    write_turn(src, "fork", 0, HISTORY_1, None)
    write_turn(src, "fork", 1, OTHER, None)  # not HISTORY_1 followed by more
    write_turn(src, "vocab", 0, [5, 9999], None)
    (src / "conversation_link").symlink_to(src / "conversation_alpha")
    return work


def import_command(work: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(COMMAND)
    assert argv[:2] == ["engram", "import-snapshots"] and SOURCE in argv and STORE in argv and REPORT in argv
    return subprocess.run([sys.executable, "-m", "engram", *argv[1:]], cwd=work, capture_output=True, text=True, timeout=600)


def by_file(report: dict) -> dict[str, dict]:
    return {f["file"]: f for f in report["files"]}


@pytest.fixture(scope="module")
def imported(work):
    first = import_command(work)
    assert first.returncode == 1 and "Traceback" not in first.stderr, first.stderr  # some files are refused
    report = json.loads((work / REPORT).read_text())
    (work / REPORT).unlink()
    second = import_command(work)
    assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr
    return first, report, json.loads((work / REPORT).read_text()), second


def test_each_file_is_imported_compared_or_refused_with_its_reason(imported):
    first, report, _, _ = imported
    files = by_file(report)
    for name, turn in (("conversation_alpha/turn_0_metadata.json", 1), ("conversation_alpha/turn_1_metadata.json", 2)):
        f = files[name]
        assert (f["status"], f["conversation_id"], f["branch"], f["turn"]) == ("imported", "alpha", "main", turn)
        assert f["recorded_state"] and not f["differs"] and f["max_rel_diff"] < 1e-4, f  # transformers' state, float32
    branch = files["conversation_alpha/branches/what-if_metadata.json"]
    assert (branch["status"], branch["branch"], branch["turn"], branch["differs"]) == ("imported", "what-if", 2, False)
    wrong = files["conversation_wrong/turn_0_metadata.json"]
    assert wrong["status"] == "imported" and wrong["differs"] and wrong["max_rel_diff"] > report["tolerance"], wrong
    stateless = files["conversation_stateless/turn_0_metadata.json"]
    assert stateless["status"] == "imported" and not stateless["recorded_state"] and stateless["differs"] is None
    reasons = {name: f["reason"] for name, f in files.items() if f["status"] == "refused"}
    assert reasons.keys() == {
        "conversation_shape/turn_0_metadata.json",
        "conversation_no-ids/turn_0_metadata.json",
        "conversation_torn/turn_0_metadata.json",
        "conversation_.hidden/turn_0_metadata.json",
        "conversation_link",
        "conversation_fork/turn_1_metadata.json",
        "conversation_vocab/turn_0_metadata.json",
    }
    assert reasons["conversation_shape/turn_0_metadata.json"].startswith("wrong model/shape: temporal has shape (2, 4, 24, 16)")
    assert reasons["conversation_no-ids/turn_0_metadata.json"].startswith("missing token ids")
    assert reasons["conversation_torn/turn_0_metadata.json"].startswith("corrupt file")
    assert reasons["conversation_.hidden/turn_0_metadata.json"].startswith("unsafe path")
    assert reasons["conversation_link"].startswith("unsafe path")
    assert reasons["conversation_fork/turn_1_metadata.json"] == "its token ids do not extend those of turn main/000001 of the conversation"
    assert reasons["conversation_vocab/turn_0_metadata.json"].startswith("wrong model: token id 9999 is outside")
    assert (report["imported"], report["differing"], report["refused"]) == (6, 1, 7)
    assert all(f["snapshot"] for f in files.values() if f["status"] == "imported")
    assert "DIFFERS" in first.stdout and "6 imported (1 of them differ" in first.stdout


def test_importing_again_changes_nothing(imported):
    _, report, again, second = imported
    assert "0 imported" in second.stdout
    for name, f in by_file(report).items():
        g = by_file(again)[name]
        expected = "unchanged" if f["status"] == "imported" else "refused"
        assert (g["status"], g["turn"], g["reason"]) == (expected, f["turn"], f["reason"]), name


def test_a_server_continues_each_imported_conversation_as_one_generate(imported, work):
    server = ServerProcess(
        ["--model-path", str(work / "granite-4.0-h-tiny"), "--snapshot-dir", str(work / STORE), "--no-enable-prefix-caching"], work / "server.log"
    )
    server.start()
    sampling = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            alpha = http.get("/v1/conversations/alpha").json()["branches"]
            assert (alpha["main"]["latest_turn"], alpha["what-if"]["latest_turn"]) == (2, 2)  # no turn twice
            for cid, branch, history in (
                ("alpha", "main", HISTORY_2),
                ("alpha", "what-if", BRANCH),
                ("wrong", "main", WRONG),
                ("stateless", "main", OTHER),
            ):
                resumed = http.post(
                    "/restore_snapshot",
                    json={
                        "conversation_id": cid,
                        "branch_name": branch,
                        "create_new_request": True,
                        "continuation_ids": CONTINUATION,
                        "sampling_params": sampling,
                    },
                )
                assert resumed.status_code == 200, resumed.text
                full = http.post("/generate", json={"input_ids": history + CONTINUATION, "sampling_params": sampling}).json()
                assert resumed.json()["output_ids"] == full["output_ids"], (cid, branch)
                assert resumed.json()["meta_info"]["cached_tokens"] == len(history)  # restored, not recomputed
                assert full["meta_info"]["cached_tokens"] == 0
            assert http.get("/v1/conversations/shape").status_code == 404
    finally:
        server.kill()
