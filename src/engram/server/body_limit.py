"""A cap on request bodies, as ASGI middleware: a body over `--max-request-bytes` is answered 413
before it is parsed, whether its size is declared (Content-Length) or only counted as it streams
in (chunked)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engram.server.errors import APIError, error_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _content_length(scope) > self.max_bytes:
            await error_response(APIError(413, self._message(), code="request_too_large"))(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # raised where the body is read: answered by the error handlers
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes, the server's --max-request-bytes"


def _content_length(scope: Scope) -> int:
    """The declared body size; 0 when none is declared (or it is not a number, which the HTTP server refuses)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
