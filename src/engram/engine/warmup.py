"""Warm-up before ready: every CUDA graph captured and the kernels of every path compiled before
the first request, so that no request waits for a compilation.

Stages (`warmup_plan`): the CUDA graphs of every batch bucket (decode; the largest batch too when
it falls between two buckets; with speculation, verify steps and their commits) and token bucket
(short prefills); then prefills of one length of
each size class (`size_class`: Triton specializes integer arguments equal to 1 or divisible by 16,
host code picks tile sizes from powers of two), one longer than a chunk (a chunk on top of KV
context), run together so that prefill and decode rows share steps; the same lengths on a context
long enough for attention to split its keys (LONG_CONTEXT_KEYS: each split count is a variant);
short prompts completing together in one step, a batch of each size class up to
--max-running-requests (the LM head, final norm and argmax over that many rows); then the
sampler's paths (greedy, sampled on the device, sampled on the host with a seed, with penalties
and logprobs). On the CPU there is nothing to compile or capture, and nothing is run (the tests
start many servers).

Compilations are counted through Triton's post-compile hook (process-wide); graph captures by the
runner. Their sum after ready is the engine's `compilations_after_ready`, which should stay 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engram.engine.request import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from engram.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

_compilations = 0
_hook_installed = False
_name_late_compilations = False


def _count_compilation(*_: object, **kwargs: object) -> bool:
    global _compilations
    _compilations += 1
    if _name_late_compilations:  # after ready: on a request's path, so say which kernel and shapes
        fn = kwargs.get("fn")
        logger.warning("Triton compilation after ready: %s %s", getattr(fn, "name", fn), " ".join(str(kwargs.get("key", "")).split()))
    return False  # never skips the compilation (the hook's return value is read before one)


def name_late_compilations() -> None:
    """From now on every Triton compilation is logged with its kernel and specialization."""
    global _name_late_compilations
    _name_late_compilations = True


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
    run: Callable[[], object]


@dataclass
class WarmupReport:
    stages: list[str] = field(default_factory=list)
    graph_captures: int = 0
    kernel_compilations: int = 0
    seconds: float = 0.0


# Keys from which a prefill's attention splits them across programs, in as many splits as its few
# programs leave room for (ops/triton_ops/attention.py, ATTENTION_SPLIT_MIN_KEYS; NSPLIT is a
# compile-time constant): a prefill on a context this long compiles its own variants.
LONG_CONTEXT_KEYS = 4096


def size_class(n: int) -> tuple[int, bool, bool]:
    """What the kernels compile separately for a size n (tokens, rows, sequences of a step): its
    power-of-two bucket (tile sizes chosen on the host) and Triton's specialization of integer
    arguments equal to 1 or divisible by 16."""
    return 1 << max(n - 1, 0).bit_length(), n == 1, n % 16 == 0


def covering_sizes(limit: int) -> list[int]:
    """The smallest size of every `size_class` that 1..limit holds."""
    smallest: dict[tuple[int, bool, bool], int] = {}
    for n in range(limit, 0, -1):
        smallest[size_class(n)] = n
    return sorted(smallest.values())


def prefill_lengths(chunk: int, limit: int) -> list[int]:
    """Prompt lengths that cover the shape specializations: `covering_sizes` of a chunk (and 3),
    the chunk and a chunk and a half (a second chunk on KV context), each below `limit`."""
    lengths = {*covering_sizes(chunk), 3, chunk, chunk + chunk // 2}
    return sorted(n for n in lengths if 0 < n < limit)


def row_counts(max_running: int) -> list[int]:
    """Numbers of sequences completing in one eager step (the logits rows: LM head, final norm,
    argmax) that cover every `size_class` up to `max_running`."""
    return covering_sizes(max_running)


SAMPLER_PATHS = (
    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),  # argmax (in the decode graph)
    SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True),  # sampled on the device
    SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True),  # on the host, a request's generator
    SamplingParams(max_tokens=4, temperature=0.7, repetition_penalty=1.1, presence_penalty=0.5, logprobs=2, ignore_eos=True),
)


@dataclass
class WarmupPlan:
    """What the warm-up runs: every graph bucket, prefill lengths (alone, together, and on a long
    context), and prompts completing together in every batch size (`row_counts`)."""

    graphs: list[tuple[str, int]]
    prefill_lengths: list[int]
    long_context_lengths: list[int]  # prefills on LONG_CONTEXT_KEYS tokens of context ([]: no room)
    row_counts: list[int]


def warmup_plan(engine: LLMEngine) -> WarmupPlan:
    limit = engine.max_context_length - 8
    lengths = prefill_lengths(engine.args.max_num_batched_tokens, limit)
    long = [n for n in lengths if LONG_CONTEXT_KEYS + n < limit and LONG_CONTEXT_KEYS + n <= engine.plan.max_total_tokens // 2]
    return WarmupPlan(engine.runner.capturable_buckets(), lengths, long, row_counts(engine.args.max_running_requests))


def warmup_stages(engine: LLMEngine) -> list[WarmupStage]:
    """What to run before ready, in order: everything on CUDA; on the CPU one short request per
    sampler path (a first request would otherwise pay torch's first-call costs, ~5x its steady time)."""
    greedy = SAMPLER_PATHS[0]
    sampler_paths = WarmupStage("sampler paths", lambda: _run(engine, [(_prompt(engine, 5 + i), p) for i, p in enumerate(SAMPLER_PATHS)]))
    if engine.device.type != "cuda":
        return [sampler_paths]
    plan = warmup_plan(engine)
    buckets = plan.graphs if engine.runner.graphs_on else []
    return [
        WarmupStage(f"CUDA graphs ({len(buckets)} buckets)", lambda: _capture_all(engine, buckets)),
        WarmupStage(
            f"prefills ({len(plan.prefill_lengths)} lengths, one at a time)",
            lambda: [_run(engine, [(_prompt(engine, n), greedy)]) for n in plan.prefill_lengths],
        ),
        WarmupStage("prefills and decodes together", lambda: _run(engine, [(_prompt(engine, n), greedy) for n in plan.prefill_lengths])),
        WarmupStage(
            f"prefills on a {LONG_CONTEXT_KEYS}-token context ({len(plan.long_context_lengths)} lengths)",
            lambda: _prefills_on_context(engine, LONG_CONTEXT_KEYS, plan.long_context_lengths),
        ),
        WarmupStage(
            f"prompts completing together ({len(plan.row_counts)} batch sizes)",
            lambda: [_run(engine, [(_prompt(engine, 2), greedy)] * rows) for rows in plan.row_counts],
        ),
        sampler_paths,
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


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], **kwargs: Any) -> list[RequestOutput]:
    """Run internal requests together until all have finished; their final outputs."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"warmup-{i}", prompt, params, internal=True, **kwargs)
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
    return finals


def _prefills_on_context(engine: LLMEngine, context: int, lengths: list[int]) -> None:
    """Prefills of `lengths` tokens, each on the state of one `context`-token prompt (restored)."""
    if not lengths:
        return
    [out] = _run(engine, [(_prompt(engine, context), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))], capture_state=True)
    state = out.state
    assert state is not None
    prefix = state.tokens[: state.state_len]
    for n in lengths:
        _run(engine, [(prefix + _prompt(engine, n), SAMPLER_PATHS[0])], initial_state=state)
