"""The warm-up plan (engine/warmup.py) against what a request can make the runner and kernels choose:
every graph bucket, and every size class of tokens and completing rows a step can have."""

from __future__ import annotations

import pytest

from engram.args import EngineArgs
from engram.engine import warmup
from engram.engine.engine import LLMEngine

MAX_RUNNING = 100  # not a graph bucket: the batches past 96 have a bucket of their own


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    context = warmup.LONG_CONTEXT_KEYS + 4096
    return LLMEngine(
        EngineArgs(
            model_path=checkpoint_dir("granite"),
            max_running_requests=MAX_RUNNING,
            max_num_batched_tokens=512,
            context_length=context,
            max_total_tokens=4 * context,
        )
    )


def classes(sizes) -> set:
    return {warmup.size_class(n) for n in sizes}


def test_the_plan_captures_every_graph_the_runner_can_pick(engine):
    plan = warmup.warmup_plan(engine)
    runner = engine.runner
    picked = {("decode", runner.decode_bucket(n)) for n in range(1, MAX_RUNNING + 1)}
    picked |= {("prefill", runner.prefill_bucket(n)) for n in range(1, engine.args.max_num_batched_tokens + 1)}
    assert picked <= set(plan.graphs)


def test_the_plan_covers_every_size_class_of_a_step(engine):
    plan = warmup.warmup_plan(engine)
    chunk = engine.args.max_num_batched_tokens
    assert classes(range(1, MAX_RUNNING + 1)) <= classes(plan.row_counts) and max(plan.row_counts) <= MAX_RUNNING
    assert classes(range(1, chunk + 1)) <= classes(plan.prefill_lengths)
    assert classes(range(1, chunk + 1)) <= classes(plan.long_context_lengths)  # the context has room for them all


def test_size_classes_tell_apart_what_the_kernels_compile_apart():
    assert warmup.size_class(16) != warmup.size_class(15)  # divisible by 16 or not, one tile bucket
    assert warmup.size_class(1) != warmup.size_class(2) and warmup.size_class(33) != warmup.size_class(65)


def test_the_long_context_stage_runs(engine):
    """Its prefills restore one captured state (only the CUDA warm-up runs it: it must work there)."""
    before = engine.stats().prefill_tokens_computed_total
    warmup._prefills_on_context(engine, 64, [1, 17, 40])
    assert not engine.has_unfinished_requests()
    assert engine.stats().prefill_tokens_computed_total - before == 64 + 1 + 17 + 40
