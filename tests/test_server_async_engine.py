"""`AsyncEngine`: the real engine on its loop thread, consumed from asyncio."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engram.args import EngineArgs
from engram.engine.async_engine import AsyncEngine, EngineDeadError
from engram.engine.engine import LLMEngine
from engram.engine.request import FinishReason, SamplingParams
from engram.models.embedded import ensure_embedded_model

PROMPT = list(b"Hello")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(ensure_embedded_model(tmp_path_factory.getbasetemp() / "engram-cache"))


@pytest.fixture
def engine(model_path):
    engine = AsyncEngine(LLMEngine(EngineArgs(model_path=model_path, max_running_requests=2, max_total_tokens=4096, context_length=512)))
    engine.start()
    yield engine
    engine.shutdown()


async def drain(engine: AsyncEngine, request_id: str, max_tokens: int) -> list:
    return [out async for out in engine.generate(request_id, PROMPT, greedy(max_tokens))]


def test_generate_streams_until_finished(engine):
    outs = asyncio.run(drain(engine, "a", 5))
    assert outs[-1].finished and outs[-1].finish_reason == FinishReason.LENGTH
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids and len(outs[-1].token_ids) == 5
    assert not any(o.finished for o in outs[:-1])
    assert engine.stats().num_running == 0 and engine.stats().generation_tokens_total == 5


def test_concurrent_requests_match_sequential(engine):
    alone = [asyncio.run(drain(engine, f"s{i}", 6))[-1].token_ids for i in range(3)]

    async def together():
        return await asyncio.gather(*(drain(engine, f"c{i}", 6) for i in range(3)))

    assert [outs[-1].token_ids for outs in asyncio.run(together())] == alone


def test_bad_input_raises_on_first_iteration(engine):
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(anext(engine.generate("x", [], greedy(2))))


def test_duplicate_id_leaves_the_original_running(engine):
    async def run():
        first = engine.generate("dup", PROMPT, greedy(20))
        await anext(first)
        with pytest.raises(ValueError, match="already in use"):
            await anext(engine.generate("dup", PROMPT, greedy(2)))
        return [out async for out in first]

    assert asyncio.run(run())[-1].finish_reason == FinishReason.LENGTH


def test_consumer_that_stops_aborts_the_request(engine):
    async def run():
        outputs = engine.generate("gone", PROMPT, greedy(400))
        await anext(outputs)
        await outputs.aclose()
        for _ in range(500):
            if engine.stats().num_running == 0:
                return
            await asyncio.sleep(0.01)

    asyncio.run(run())
    stats = engine.stats()
    assert stats.num_running == 0 and stats.state_slots_used == 0
    assert stats.generation_tokens_total < 400


def test_cancelled_consumer_aborts_the_request(engine):
    async def run():
        async def consume():
            async for _ in engine.generate("cancelled", PROMPT, greedy(400)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while engine.stats().num_running:
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(run(), 10))
    assert engine.stats().generation_tokens_total < 400


def test_abort_emits_a_final_abort_output(engine):
    async def run():
        outputs = engine.generate("to-abort", PROMPT, greedy(400))
        await anext(outputs)
        await engine.abort("to-abort")
        return [out async for out in outputs]

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].finish_reason == FinishReason.ABORT


def test_a_failed_step_fails_its_requests_and_the_engine_recovers(engine):
    step = engine.engine.step
    calls = {"n": 0}

    def failing_once():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return step()

    engine.engine.step = failing_once
    with pytest.raises(RuntimeError, match="engine step failed.*boom"):
        asyncio.run(drain(engine, "victim", 10))
    assert asyncio.run(drain(engine, "next", 3))[-1].finish_reason == FinishReason.LENGTH
    assert engine.is_alive and engine.stats().num_running == 0


def test_an_engine_that_keeps_failing_is_declared_dead(engine):
    def broken():
        raise RuntimeError("broken for good")

    engine.engine.step = broken
    with pytest.raises(RuntimeError, match="broken for good"):
        asyncio.run(drain(engine, "victim", 10))
    with pytest.raises(EngineDeadError, match="broken for good"):
        asyncio.run(drain(engine, "after", 2))
    assert not engine.is_alive


def test_a_consumer_that_falls_behind_gets_the_outputs_merged(engine):
    """Outputs that queued up while the consumer was busy come as one, whose deltas are theirs."""

    async def slow():
        outputs = engine.generate("slow", PROMPT, greedy(48))
        outs = [await anext(outputs)]
        await asyncio.sleep(0.5)  # the engine goes on meanwhile
        return outs + [out async for out in outputs]

    fast = asyncio.run(drain(engine, "fast", 48))[-1]
    outs = asyncio.run(slow())
    assert len(outs[1].new_token_ids) > 1  # the queued outputs, in one
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids == fast.token_ids
    assert "".join(o.new_text for o in outs) == outs[-1].text == fast.text
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])


def test_a_step_wakes_each_event_loop_once(engine):
    """A step's outputs for several requests reach their event loop in one call (each call writes
    the loop's wake-up pipe), not one call per request."""
    counts = {"calls": 0, "steps": 0}
    step = engine.engine.step

    def counted_step():
        counts["steps"] += 1
        return step()

    engine.engine.step = counted_step

    async def run():
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            if threading.current_thread().name == "engram-engine":
                counts["calls"] += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        return await asyncio.gather(*(drain(engine, f"w{i}", 24) for i in range(2)))

    results = asyncio.run(run())
    assert all(outs[-1].finished and len(outs[-1].token_ids) == 24 for outs in results)
    assert counts["calls"] <= counts["steps"] + 2  # one a step (and one for each request's add command)
