"""Warm-up before ready: every CUDA graph captured and the kernels of every path compiled before
the first request, so that no request waits for a compilation.

Stages: the CUDA graphs of every batch bucket (decode) and token bucket (short prefills); then
prefills of lengths that cover the kernels' shape specializations (Triton specializes integer
arguments equal to 1 or divisible by 16; host code picks tile sizes from powers of two), one
longer than a chunk (a chunk on top of KV context), run together so that prefill and decode rows
share steps; then the sampler's paths (greedy, sampled on the device, sampled on the host with a
seed, with penalties and logprobs). On the CPU there is nothing to compile or capture, and
nothing is run (the tests start many servers).

Compilations are counted through Triton's post-compile hook (process-wide); graph captures by the
runner. Their sum after ready is the engine's `compilations_after_ready`, which should stay 0.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engram.engine.request import SamplingParams

if TYPE_CHECKING:
    from engram.engine.engine import LLMEngine

_compilations = 0
_hook_installed = False


def _count_compilation(*_: object, **__: object) -> bool:
    global _compilations
    _compilations += 1
    return False  # never skips the compilation (the hook's return value is read before one)


def install_compile_counter() -> bool:
    """Count Triton kernel compilations from now on (a no-op without Triton). Returns whether it counts."""
    global _hook_installed
    if _hook_installed:
        return True
    try:
        import triton
    except ImportError:
        return False
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):  # triton >= 3.4
        runtime.jit_post_compile_hook = _count_compilation
    else:
        from triton.runtime.jit import JITFunction

        JITFunction.compiled_hook = _count_compilation
    _hook_installed = True
    return True


def kernel_compilations() -> int:
    """Triton compilations in this process so far."""
    return _compilations


@dataclass
class WarmupStage:
    name: str
    run: Callable[[], None]


@dataclass
class WarmupReport:
    stages: list[str] = field(default_factory=list)
    graph_captures: int = 0
    kernel_compilations: int = 0
    seconds: float = 0.0


def prefill_lengths(chunk: int, limit: int) -> list[int]:
    """Prompt lengths that cover the shape specializations: 2^k and 2^k + 1 up to a chunk, the
    chunk itself and a chunk and a half (a second chunk on KV context), each below `limit`."""
    powers = itertools.takewhile(lambda n: n <= chunk, (1 << k for k in itertools.count()))
    lengths = {m for n in powers for m in (n, n + 1)} | {3, chunk, chunk + chunk // 2}
    return sorted(n for n in lengths if 0 < n < limit)


SAMPLER_PATHS = (
    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),  # argmax (in the decode graph)
    SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True),  # sampled on the device
    SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True),  # on the host, a request's generator
    SamplingParams(max_tokens=4, temperature=0.7, repetition_penalty=1.1, presence_penalty=0.5, logprobs=2, ignore_eos=True),
)


def warmup_stages(engine: LLMEngine) -> list[WarmupStage]:
    """What to run before ready, in order: everything on CUDA, nothing on the CPU."""
    runner = engine.runner
    if engine.device.type != "cuda":
        return []
    limit = engine.max_context_length - 8
    lengths = prefill_lengths(engine.args.max_num_batched_tokens, limit)
    buckets = runner.graph_buckets()
    return [
        WarmupStage(f"CUDA graphs ({len(buckets)} buckets)", lambda: _capture_all(engine, buckets)),
        WarmupStage(f"prefills ({len(lengths)} lengths, one at a time)", lambda: [_run(engine, [(_prompt(engine, n), SAMPLER_PATHS[0])]) for n in lengths]),
        WarmupStage("prefills and decodes together", lambda: _run(engine, [(_prompt(engine, n), SAMPLER_PATHS[0]) for n in lengths])),
        WarmupStage("sampler paths", lambda: _run(engine, [(_prompt(engine, 5 + i), p) for i, p in enumerate(SAMPLER_PATHS)])),
    ]


def warm_up(engine: LLMEngine, on_stage: Callable[[str, int, int], None] | None = None) -> WarmupReport:
    """Run the warm-up stages on an idle engine; `on_stage(name, number, count)` before each."""
    started, compiled, captured = time.perf_counter(), kernel_compilations(), engine.runner.num_graph_captures
    report = WarmupReport()
    stages = warmup_stages(engine)
    for i, stage in enumerate(stages):
        if on_stage is not None:
            on_stage(stage.name, i + 1, len(stages))
        stage.run()
        report.stages.append(stage.name)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    report.graph_captures = engine.runner.num_graph_captures - captured
    report.kernel_compilations = kernel_compilations() - compiled
    report.seconds = time.perf_counter() - started
    return report


def _capture_all(engine: LLMEngine, buckets: list[tuple[str, int]]) -> None:
    from tqdm import tqdm

    for kind, size in tqdm(buckets, desc="capturing CUDA graphs", unit="graph", disable=None):
        engine.runner.capture(kind, size)


def _prompt(engine: LLMEngine, n: int) -> list[int]:
    return [(7 * i + 1) % engine.spec.vocab_size for i in range(n)]


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> None:
    """Run internal requests together until all have finished."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"warmup-{i}", prompt, params, internal=True)
    while engine.has_unfinished_requests():
        engine.step()
