"""Helpers for driving an LLMEngine directly in tests."""

from __future__ import annotations

import torch

from engram.args import EngineArgs
from engram.engine.engine import LLMEngine
from engram.engine.request import RequestOutput, SamplingParams


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
