"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import train_demo_smoke, write_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def engram_cache(tmp_path_factory):
    """Keep the embedded model and default snapshot folder of every test out of the home folder."""
    cache = tmp_path_factory.getbasetemp() / "engram-cache"
    mp = pytest.MonkeyPatch()
    mp.setenv("ENGRAM_CACHE_DIR", str(cache))
    yield cache
    mp.undo()


@pytest.fixture(scope="module", autouse=True)
def kernel_dispatch():
    """Each test module leaves the kernels as it found them: an engine installs its device's
    kernels process-wide, and a GPU module's CUDA ones must not reach a later module's CPU tensors."""
    from engram.ops.dispatch import kernels, use_kernels

    before = kernels()
    yield
    use_kernels(before)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory, request):
    """checkpoint_dir(kind) -> folder of a tiny random checkpoint of that kind (cached per session);
    kind "demo": the demo model's smoke run (dense Granite MLPs, trained a few steps, bfloat16 weights)."""
    made: dict[str, str] = {}

    def make(kind: str) -> str:
        if kind == "demo":
            return str(request.getfixturevalue("demo_checkpoint")[0])
        if kind not in made:
            made[kind] = str(write_checkpoint(kind, tmp_path_factory.mktemp(kind)))
        return made[kind]

    return make


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(path) -> the transformers model of a checkpoint, float32, eval mode (cached)."""
    from transformers import AutoModelForCausalLM

    loaded: dict[str, torch.nn.Module] = {}

    def load(path: str) -> torch.nn.Module:
        if path not in loaded:
            loaded[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return loaded[path]

    return load


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory) -> tuple[Path, str]:
    """(folder, stdout) of one smoke run of the demo model's training script."""
    out = tmp_path_factory.mktemp("demo") / "model"
    return out, train_demo_smoke(out)
