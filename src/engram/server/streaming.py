"""Server-sent events, and aborting a request whose client has gone away.

A streaming response is cancelled by Starlette when its client disconnects; the cancellation
closes the engine stream, which aborts the request. A non-streaming handler gets the same
treatment from `cancel_on_disconnect`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ParamSpec, TypeVar, cast

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from engram.server.errors import error_body, error_for

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


SSE_DONE = "data: [DONE]\n\n"
TEXT_MARK = "\ue000engram-text\ue000"  # private-use characters: stands for the text in a chunk's template
_encode_string = json.JSONEncoder(ensure_ascii=False).encode  # pydantic's escaping: only what JSON requires


def sse(data: BaseModel | dict[str, Any]) -> str:
    payload = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


def text_event(build: Callable[[str], BaseModel]) -> Callable[[str], str]:
    """`lambda text: sse(build(text))`, with the chunk serialized once, around TEXT_MARK: a streamed
    token then costs one string escape instead of building and serializing pydantic models."""
    head, mark, tail = sse(build(TEXT_MARK)).partition(_encode_string(TEXT_MARK))
    if not mark or TEXT_MARK in head + tail:  # the mark is not (only) where the text goes
        return lambda text: sse(build(text))
    return lambda text: head + _encode_string(text) + tail


class TextEvents:
    """`text_event` of the chunk `build(choice index, text)`, made for each choice on first use."""

    def __init__(self, build: Callable[[int, str], BaseModel]) -> None:
        self._build = build
        self._events: dict[int, Callable[[str], str]] = {}

    def __call__(self, index: int, text: str) -> str:
        event = self._events.get(index)
        if event is None:
            event = self._events[index] = text_event(functools.partial(self._build, index))
        return event(text)


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """Stream `events`, then `data: [DONE]`. An error after the headers went out is sent in-band."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as e:
            logger.exception("streaming request failed")
            yield sse(error_body(error_for(e)))
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def cancel_on_disconnect(handler: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R | Response]]:
    """Run a route handler (which takes `raw_request: Request`) as a task that is cancelled if the
    client disconnects first; cancelling it aborts its engine request and frees the slot."""

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | Response:
        work = asyncio.ensure_future(handler(*args, **kwargs))
        watch = asyncio.ensure_future(_client_gone(cast(Request, kwargs["raw_request"])))
        try:
            done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
        if work not in done:
            return Response(status_code=499)  # nobody will read it
        return work.result()

    return wrapper
