"""Every error the server answers, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engram.engine.async_engine import EngineDeadError
from engram.state.snapshot import (
    InvalidIdError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotIncompatibleError,
    SnapshotLinkError,
    SnapshotNotFoundError,
    reason_without_paths,
)
from engram.state.turns import (
    ConversationBusyError,
    ConversationConflictError,
    ConversationError,
    ConversationNotFoundError,
    StaleViewError,
    TurnMismatchError,
)

log = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    422: "invalid_request_error",
    503: "service_unavailable",
}


SNAPSHOT_TAG = "snapshots"  # routes with this tag answer invalid bodies with 422, as the snapshot API did


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.extra = extra or {}  # more fields of the error object


# Conversation and snapshot failures: 404 not found, 409 busy or unusable, 422 invalid.
_STATUS_OF = (
    (InvalidIdError, 422, "invalid_id"),
    (ConversationNotFoundError, 404, "conversation_not_found"),
    (SnapshotNotFoundError, 404, "snapshot_not_found"),
    (ConversationBusyError, 409, "conversation_busy"),
    (StaleViewError, 409, "stale_view"),
    (ConversationConflictError, 409, "conversation_conflict"),
    (SnapshotIncompatibleError, 409, "snapshot_incompatible"),
    (SnapshotCorruptError, 409, "snapshot_corrupt"),
    (SnapshotLinkError, 409, "snapshot_link_refused"),
    (SnapshotError, 409, "snapshot_unavailable"),
)


def error_for(exc: Exception) -> APIError:
    """The API error an exception stands for: its own status, 503 for a dead engine or a storage
    failure, else 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    if isinstance(exc, TurnMismatchError):
        return APIError(409, str(exc), code="turn_mismatch", extra={"current_turn": exc.current_turn})
    for kind, status, code in _STATUS_OF:
        if isinstance(exc, kind):
            return APIError(status, str(exc), code=code)
    if isinstance(exc, OSError):  # the snapshot and record files: a full disk, a folder it may not write
        message = f"the server could not read or write its conversation storage: {reason_without_paths(exc)}"
        return APIError(503, message, code="storage_unavailable")
    return APIError(500, f"internal error: {exc!r}")


def error_body(err: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    # `success` is the snapshot API's field (its predecessor's clients test it).
    return {"success": False, "error": {"message": err.message, "type": kind, "param": err.param, "code": err.code, **err.extra}}


def error_response(err: APIError) -> JSONResponse:
    if 400 <= err.status < 500:  # the client's mistake: why, for whoever debugs it
        log.debug("answered %d (%s): %s", err.status, err.code or _ERROR_TYPES.get(err.status, "client error"), err.message)
    return JSONResponse(error_body(err), status_code=err.status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    messages, first_param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        where = ".".join(loc)
        first_param = first_param or where or None
        messages.append(f"{where}: {err['msg']}" if where else err["msg"])
    return "; ".join(messages) or "invalid request", first_param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        route = request.scope.get("route")
        status = 422 if route is not None and SNAPSHOT_TAG in getattr(route, "tags", ()) else 400
        return error_response(APIError(status, message, param=param))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(APIError(exc.status_code, message))

    async def _any(_: Request, exc: Exception) -> JSONResponse:
        return error_response(error_for(exc))

    # Known errors get their own entries so that Starlette answers them without re-raising;
    # what reaches the catch-all `Exception` entry is answered, then re-raised (logged).
    for kind in (APIError, EngineDeadError, ConversationError, SnapshotError, Exception):
        app.add_exception_handler(kind, _any)
