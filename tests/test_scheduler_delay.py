"""--scheduler-delay-factor: while sequences decode, a waiting one is admitted once the oldest has
waited that many times the last admitting step (vLLM's rule), or once the waiting fill a step."""

import pytest
from engine_utils import greedy, make_engine, random_prompt, run_to_end


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _engine(path, factor: float, **kw):
    engine = make_engine(path, scheduler_delay_factor=factor, **kw)
    clock = FakeClock()
    engine.scheduler.clock = clock
    return engine, clock


def _admitted_after_waiting(engine, clock) -> list[int]:
    """r0 admitted at t=0 (nothing runs: no delay), its admitting step taking 4 ticks of 1/64 s (exact
    in binary); r1 arrives at tick 5. A step every tick from then on: the ticks at which r1 still waits."""
    tick = 1 / 64
    engine.add_request("r0", random_prompt(20, seed=1), greedy(40))
    engine.step()  # admits r0 at t=0
    clock.now = 4 * tick
    engine.step()  # the admitting step took 4 ticks
    clock.now = 5 * tick
    engine.add_request("r1", random_prompt(9, seed=2), greedy(4))
    waited = []
    while engine.scheduler.waiting:
        clock.now += tick
        engine.step()
        if engine.scheduler.waiting:
            waited.append(round(clock.now / tick))
    return waited


def test_a_waiting_request_is_admitted_after_factor_times_the_admitting_step(checkpoint_dir):
    engine, clock = _engine(checkpoint_dir("mamba2"), 1.0)
    # due once it has waited >= 1.0 x 4 ticks: at the steps of ticks 6, 7, 8 it had waited 1..3
    assert _admitted_after_waiting(engine, clock) == [6, 7, 8]
    assert run_to_end(engine).keys() == {"r0", "r1"}


def test_without_a_delay_factor_a_waiting_request_is_admitted_at_its_first_prefill_turn(checkpoint_dir):
    engine, clock = _engine(checkpoint_dir("mamba2"), 0.0)
    assert _admitted_after_waiting(engine, clock) == []


def test_nothing_running_or_a_full_step_of_waiting_tokens_is_admitted_at_once(checkpoint_dir):
    engine, clock = _engine(checkpoint_dir("mamba2"), 100.0, max_num_batched_tokens=32)
    engine.add_request("a", random_prompt(8, seed=3), greedy(30))
    engine.step()
    assert not engine.scheduler.waiting  # nothing was running
    clock.now = 0.05
    engine.step()
    engine.add_request("b", random_prompt(8, seed=4), greedy(2))
    for _ in range(2):
        engine.step()
    assert engine.scheduler.waiting  # 8 tokens wait: under the 32-token budget, delayed
    engine.add_request("c", random_prompt(30, seed=5), greedy(2))
    for _ in range(2):
        engine.step()
    assert not engine.scheduler.waiting  # 38 tokens wait: they fill a step


def test_delayed_admission_changes_no_output(checkpoint_dir):
    path = checkpoint_dir("mamba2")
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 11)]
    alone = []
    for p in prompts:
        engine = make_engine(path)
        engine.add_request("r", p, greedy(10))
        alone.append(run_to_end(engine)["r"].token_ids)
    engine, clock = _engine(path, 2.0)
    outs = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(10))
        for _ in range(3):
            clock.now += 0.01
            outs |= {o.request_id: o for o in engine.step() if o.finished}
    outs |= run_to_end(engine)
    assert [outs[f"r{i}"].token_ids for i in range(len(prompts))] == alone


def test_a_negative_delay_factor_is_refused(checkpoint_dir):
    with pytest.raises(ValueError, match="--scheduler-delay-factor"):
        make_engine(checkpoint_dir("mamba2"), scheduler_delay_factor=-1.0)
