"""Helpers for driving an LLMEngine directly in tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engram.args import EngineArgs
from engram.engine.engine import LLMEngine
from engram.engine.request import RequestOutput, SamplingParams
from engram.state.chunks import STORE_NAME


def make_engine(path: str, **overrides) -> LLMEngine:
    args = dict(model_path=path, max_total_tokens=4096, max_running_requests=8, max_num_batched_tokens=512)
    return LLMEngine(EngineArgs(**{**args, **overrides}))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_to_end(engine: LLMEngine) -> dict[str, RequestOutput]:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def record_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """Every logits tensor the runner returns from now on, in order."""
    seen: list[torch.Tensor] = []
    run = engine.runner.run

    def recording(chunks):
        logits = run(chunks)
        seen.append(logits.clone())
        return logits

    engine.runner.run = recording
    return seen


def random_prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def store_file(manifest_path: Path, piece: int | None = None) -> Path:
    """The store file a turn's v2 manifest names: its checkpoint, or its `piece`-th KV piece."""
    refs = json.loads(manifest_path.read_text())["store"]
    kind, key = ("ckpt", refs["checkpoint"][0]) if piece is None else ("kv", refs["pieces"][piece][2])
    return manifest_path.parents[2] / STORE_NAME / kind / key[:2] / f"{key}.safetensors"
