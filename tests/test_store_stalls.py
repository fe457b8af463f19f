"""A slow or stalled object store holds up only the conversation waiting on it (issue 35): the
conversation manager makes no store call under its own lock. Each test stalls the store's record
calls for conversation "a" (obstore's in-memory store behind them) and takes a whole turn of
conversation "b" meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_utils import greedy, make_engine, random_prompt, run_to_end
from test_conversations import full_generation, take_turn
from test_object_store import replica

from engram.state.conversations import ConversationManager
from engram.state.turns import retain_key

pytest.importorskip("obstore")

WAIT_S = 30.0


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return make_engine(checkpoint_dir("nemotron"))


class Stall:
    """Makes the store's `method` wait, for calls about `conversation_id`, until `release`."""

    def __init__(self, manager: ConversationManager, method: str, conversation_id: str):
        self.entered, self._go = threading.Event(), threading.Event()
        original: Callable = getattr(manager.store, method)

        def stalled(cid: str, *args):
            if cid == conversation_id:
                self.entered.set()
                self._go.wait(WAIT_S)
            return original(cid, *args)

        setattr(manager.store, method, stalled)

    def release(self) -> None:
        self._go.set()


def turn_of_b_meanwhile(engine, manager: ConversationManager, stall: Stall, stalled: Callable[[], object]) -> None:
    """Run `stalled` (a call that reaches the stalled store) in a thread; once it waits on the
    store, a turn of "b" must complete (recorded in the store, exact) while it still waits."""
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(stalled)
        try:
            assert stall.entered.wait(WAIT_S)
            history = manager.require("b").tokens(manager.require("b").latest("main"))
            new = random_prompt(3, 41)
            turn, out, _, _ = pool.submit(take_turn, engine, manager, "b", new).result(timeout=WAIT_S)
            assert not waiting.done()  # "a" is still waiting on the store
        finally:
            stall.release()
        waiting.result(timeout=WAIT_S)
    assert out.token_ids == full_generation(engine, history + new)
    assert manager.store.read_record("b") is not None and manager.require("b").latest("main") is turn


@pytest.mark.parametrize("method", ["read_record", "record_current"])
def test_a_turn_goes_on_while_another_conversations_record_read_is_stalled(engine, tmp_path, method):
    """Replica 2 begins a turn of "a": its record read (never loaded here) or its ETag check (loaded
    before) waits on the store; replica 2's turn of "b" does not."""
    first = replica(engine, tmp_path / "1")
    take_turn(engine, first, "a", random_prompt(9, 1))
    second = replica(engine, tmp_path / "2", shared=first)
    take_turn(engine, second, "b", random_prompt(7, 2))
    if method == "record_current":
        second.require("a")
    stall = Stall(second, method, "a")
    turn_of_b_meanwhile(engine, second, stall, lambda: second.release(second.begin("a").conversation_id))


def test_a_turn_goes_on_while_another_conversations_record_write_is_stalled(engine, tmp_path):
    """Turn 2 of "a" is generated; recording it waits on the store; a turn of "b" does not, and
    "a"'s turn is recorded once the store answers."""
    manager = replica(engine, tmp_path)
    take_turn(engine, manager, "a", random_prompt(9, 3))
    take_turn(engine, manager, "b", random_prompt(7, 4))
    plan = manager.begin("a")
    prompt = plan.history_tokens + random_prompt(4, 5)
    engine.add_request("t", prompt, greedy(4), initial_state=plan.state, capture_state=True, retain_key=retain_key("a", plan.ref))
    out = run_to_end(engine)["t"]
    stall = Stall(manager, "write_record", "a")
    turn_of_b_meanwhile(engine, manager, stall, lambda: manager.finish(plan, prompt, out.token_ids, [{"role": "user", "content": "x"}], out.state))
    assert replica(engine, tmp_path / "other", shared=manager).require("a").latest("main").turn == 2
