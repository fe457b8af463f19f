"""`AsyncEngine`: an `LLMEngine` driven by one background thread, consumed from asyncio.

The engine is not thread-safe, so only the loop thread touches it. Every other call (add, abort,
flush) is queued as a command that the thread runs between steps; results come back through
futures. A step's outputs go to each event loop in one `call_soon_threadsafe` (not one per
request: each call writes the loop's wake-up pipe, a system call that gives the GIL away), and a
consumer that has fallen behind takes the outputs queued for it as one (`merge_outputs`), so a
busy event loop sends fewer, larger chunks instead of falling further behind.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from engram.engine.request import RequestOutput, SamplingParams, merge_outputs

if TYPE_CHECKING:
    from engram.engine.engine import EngineStats, LLMEngine
    from engram.engine.warmup import WarmupReport

logger = logging.getLogger(__name__)
T = TypeVar("T")
Item = RequestOutput | BaseException
# A request's outputs: closing it (`aclose`, `contextlib.aclosing`) aborts the request.
RequestOutputs: TypeAlias = AsyncGenerator[RequestOutput, None]


class EngineDeadError(RuntimeError):
    """The loop thread has stopped: shut down, or the engine failed twice in a row."""


class _Stream:
    """One request's outputs, delivered on its consumer's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def push(self, item: Item) -> None:
        """On the consumer's loop."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> Item:
        """The next output (the outputs that arrived since the last call, merged into one), or the
        error the engine sent instead."""
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        while not isinstance(item, BaseException) and self._items and isinstance(following := self._items[0], RequestOutput):
            self._items.popleft()
            item = merge_outputs(item, following)
        return item


def _push_all(items: list[tuple[_Stream, Item]]) -> None:
    for stream, item in items:
        stream.push(item)


def _send(items: Iterable[tuple[_Stream, Item]]) -> None:
    """Deliver items from the loop thread: one call per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Item]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_push_all, batch)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._streams: dict[str, _Stream] = {}  # live requests; loop thread only
        self._stats = engine.stats()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engram-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self.engine.close()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- API (event loop side) -------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs: Any) -> RequestOutputs:
        """Yield the request's outputs until it finishes. Bad input raises ValueError on the
        first iteration; a consumer that stops early aborts the request."""
        stream = _Stream(asyncio.get_running_loop())
        finished = False
        try:
            await self._call(lambda: self._add(request_id, prompt_token_ids, params, stream, kwargs))
            while not finished:
                item = await stream.next()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._submit(lambda: self._abort(request_id, stream))

    async def abort(self, request_id: str) -> None:
        """Abort a running request; its consumer receives a final output with reason ABORT."""
        await self._call(lambda: self._abort(request_id, None))

    async def abort_all(self, prefix: str = "") -> None:
        """Abort every running request (whose id starts with `prefix`)."""

        def abort_matching() -> None:
            for request_id in list(self._streams):
                if request_id.startswith(prefix):
                    self._abort(request_id, None)

        await self._call(abort_matching)

    async def flush_cache(self) -> bool:
        return await self._call(self.engine.flush_cache)

    async def release_retained(self, key: str) -> bool:
        """Free a finished conversation's retained engine slot (ACTIVE -> WARM)."""
        return await self._call(lambda: self.engine.release_retained(key))

    async def warm_up(self, on_stage: Callable[[str, int, int], None] | None = None, enabled: bool = True) -> WarmupReport | None:
        """Warm the engine up on the loop thread (requests that arrive meanwhile wait behind it),
        then mark it ready; `enabled` False marks it ready at once."""

        def run() -> WarmupReport | None:
            report = self.engine.warm_up(on_stage) if enabled else None
            self.engine.mark_ready()
            return report

        return await self._call(run)

    def stats(self) -> EngineStats:
        """The engine's stats as of the end of the last loop iteration."""
        return self._stats

    async def _call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self._submit(fn))

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._cond:
            if self._error is not None or self._stopping:
                future.set_exception(EngineDeadError(f"engine is not running: {self._error or 'shut down'}"))
                return future
            self._commands.append((fn, future))
            self._cond.notify()
        return future

    # -- loop thread -----------------------------------------------------------------------

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream: _Stream, kwargs: dict[str, Any]) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params, **kwargs)
        self._streams[request_id] = stream

    def _abort(self, request_id: str, stream: _Stream | None) -> None:
        """Abort `request_id` if it is still running (and, given `stream`, still that consumer's)."""
        live = self._streams.get(request_id)
        if live is not None and (stream is None or live is stream):
            self.engine.abort_request(request_id)

    @staticmethod
    def _run_commands(commands: list[tuple[Callable[[], Any], Future[Any]]]) -> None:
        for fn, future in commands:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:  # reported to the caller
                    future.set_exception(e)

    def _run(self) -> None:
        failed_last_step = False
        while True:
            with self._cond:
                while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                    self._cond.wait()
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            self._run_commands(commands)
            del commands  # a command may hold a state to restore: not kept while idle
            outputs: list[RequestOutput] = []
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                    failed_last_step = False
                except Exception as e:
                    logger.exception("engine step failed")
                    if failed_last_step:  # aborting the failed batch did not recover the engine
                        self._error = e
                        break
                    failed_last_step = True
                    self._fail_running(e)
            self._stats = self.engine.stats()  # before dispatch: no consumer sees stats older than its output
            self._dispatch(outputs)
        self._close(self._error or EngineDeadError("engine shut down"))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        items = []
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                items.append((stream, out))
        if items:
            _send(items)

    def _fail_running(self, error: Exception) -> None:
        """Report a failed step to every request in it and abort them, leaving the engine empty."""
        failed: list[tuple[_Stream, Item]] = []
        for request_id in list(self._streams):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s after a failed step failed", request_id)
            failed.append((self._streams.pop(request_id), RuntimeError(f"engine step failed: {error!r}")))
        _send(failed)

    def _close(self, error: BaseException) -> None:
        with self._cond:
            self._stopping = True
            commands, self._commands = self._commands, []
        for _, future in commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(str(error)))
        _send((stream, EngineDeadError(str(error))) for stream in self._streams.values())
        self._streams.clear()
