"""Bearer-key auth as ASGI middleware, so it runs before routing and body parsing on every route.

`--api-key` guards every route but the probes (the admin key is accepted too), which stay open as
in SGLang so that load balancers and Prometheus need no key. `--admin-api-key` guards the admin
routes; without it they take the API key. Whoever opens the admin routes is an admin (everyone,
when no key is set): the caller's role is `request.state.is_admin`, for routes that show admins more.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from engram.server.errors import APIError, error_response

PROBE_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


@dataclass(frozen=True)
class AuthConfig:
    api_key: str | None
    admin_api_key: str | None
    admin_paths: frozenset[str]

    def allowed_keys(self, path: str) -> list[str]:
        """The keys that open `path`; none: it is open."""
        if path in PROBE_PATHS:
            return []
        if path in self.admin_paths and self.admin_api_key:
            return [self.admin_api_key]
        return [k for k in (self.api_key, self.admin_api_key if self.api_key else None) if k]

    def is_admin(self, token: str | None) -> bool:
        """Whether `token` opens the admin routes."""
        keys = [k for k in (self.admin_api_key or self.api_key,) if k]
        return not keys or _matches(token, keys)


def _matches(token: str | None, keys: list[str]) -> bool:
    return token is not None and any(secrets.compare_digest(token.encode(), k.encode()) for k in keys)


def caller_is_admin(request: Request) -> bool:
    return request.state.is_admin


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class AuthMiddleware:
    def __init__(self, app: ASGIApp, config: AuthConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            keys = self.config.allowed_keys(scope["path"])
            token = _bearer(scope)
            if keys and not _matches(token, keys):
                message = "missing API key" if token is None else "invalid API key"
                response = error_response(APIError(401, f"{message}: send `Authorization: Bearer <key>`", code="invalid_api_key"))
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["is_admin"] = self.config.is_admin(token)
        await self.app(scope, receive, send)
