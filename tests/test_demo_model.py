"""The demo model's training script (smoke mode, CPU) and the built-in model names."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
from checkpoints import train_demo_smoke
from engine_utils import assert_greedy_matches_transformers, greedy, make_engine
from test_byte_tokenizer_and_embedded import TEXTS

import engram.models.builtin as builtin
from engram import LLM
from engram.models.spec import ConfigError, load_model_spec


@pytest.fixture(scope="module")
def demo_tokenizer(demo_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_checkpoint[0], local_files_only=True)


def test_smoke_run_writes_a_checkpoint_that_the_engine_serves_as_transformers_does(demo_checkpoint, demo_tokenizer, hf_model):
    path, _ = demo_checkpoint
    spec = load_model_spec(path)
    assert spec.model_type == "granitemoehybrid" and len(spec.mamba_layers) == 3
    assert len(spec.attention_layers) == 1
    assert spec.eos_token_ids == (demo_tokenizer.eos_token_id,)
    prompt = demo_tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True, return_dict=False)
    assert_greedy_matches_transformers(make_engine(str(path)), hf_model(str(path)), list(prompt), 12)


def test_smoke_run_reports_held_out_perplexity_below_the_untrained_model(demo_checkpoint):
    path, stdout = demo_checkpoint
    record = json.loads((path / "training.json").read_text())
    untrained, trained = record["heldout"]["untrained"]["perplexity"], record["heldout"]["trained"]["perplexity"]
    assert f"untrained: held-out perplexity {untrained:.1f}" in stdout and f"held-out perplexity {trained:.2f}" in stdout
    assert trained < 0.9 * untrained
    assert record["training"]["steps"] == 5 and record["heldout"]["trained"]["tokens"] > 0


def test_full_size_weights_fit_the_budget(demo_checkpoint):
    """The smoke run has the shipped architecture with a smaller vocabulary; at 4096 tokens the
    tied embedding adds (4096 - 512) x 256 parameters."""
    path, _ = demo_checkpoint
    record = json.loads((path / "training.json").read_text())
    parameters = record["model"]["parameters"] + (4096 - json.loads((path / "config.json").read_text())["vocab_size"]) * 256
    assert parameters * 2 <= 8_000_000  # bfloat16
    assert (path / "model.safetensors").stat().st_size < record["model"]["weight_bytes"] + 100_000


def test_tokenizer_round_trips_stdlib_sources_and_any_text(demo_tokenizer):
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in root.glob("*.py"))[::20]
    assert len(sources) > 5
    for text in [*(p.read_text(encoding="utf-8") for p in sources), *TEXTS]:
        ids = demo_tokenizer.encode(text)
        assert demo_tokenizer.decode(ids) == text
    code = (root / "bisect.py").read_text()
    assert len(demo_tokenizer.encode(code)) < 0.7 * len(code.encode())  # merges learned (256 in a smoke run), not bytes alone


def test_training_is_deterministic(demo_checkpoint, tmp_path):
    path, _ = demo_checkpoint
    train_demo_smoke(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (path / name).read_bytes(), name


def test_builtin_names(demo_checkpoint, tmp_path, monkeypatch):
    path, _ = demo_checkpoint
    monkeypatch.setattr(builtin, "DEMO_MODEL_DIR", tmp_path / "absent")
    with pytest.raises(ConfigError, match="scripts/train_demo_model.py"):
        builtin.resolve_model("demo")
    monkeypatch.setattr(builtin, "DEMO_MODEL_DIR", path)
    assert builtin.resolve_model("demo") == builtin.ResolvedModel(str(path), builtin.DEMO_MODEL_NAME)
    assert builtin.resolve_model(None) == builtin.resolve_model(builtin.DEFAULT_MODEL)
    assert builtin.resolve_model("embedded").served_name == "engram-embedded-hybrid"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    assert builtin.resolve_model("demo") == builtin.ResolvedModel("demo", None)  # a folder of that name wins


def test_llm_loads_the_demo_by_name(demo_checkpoint, monkeypatch):
    path, _ = demo_checkpoint
    monkeypatch.setattr(builtin, "DEMO_MODEL_DIR", path)
    llm = LLM("demo", max_total_tokens=1024, max_running_requests=2)
    assert llm.engine.model_path == path
    out = llm.generate("def add(a, b):", greedy(4))[0]
    assert len(out.token_ids) == 4
