"""A cap on request bodies, as ASGI middleware: a body over `--max-request-bytes` (or a route's own
larger cap: an import) is answered 413 before it is parsed, whether its size is declared
(Content-Length) or only counted as it streams in (chunked)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engram.server.errors import APIError, error_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}  # path -> its own cap

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.larger.get(scope["path"], self.max_bytes)
        if _content_length(scope) > cap:
            await error_response(APIError(413, self._message(cap), code="request_too_large"))(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:  # raised where the body is read: answered by the error handlers
                    raise HTTPException(413, self._message(cap))
            return message

        await self.app(scope, counted, send)

    def _message(self, cap: int) -> str:
        flag = "--max-request-bytes" if cap == self.max_bytes else "--max-import-bytes"
        return f"the request body is larger than {cap} bytes, the server's {flag}"


def _content_length(scope: Scope) -> int:
    """The declared body size; 0 when none is declared (or it is not a number, which the HTTP server refuses)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
