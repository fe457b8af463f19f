"""Bearer-key auth as ASGI middleware, so it runs before routing and body parsing on every route.

The user keys (`--api-key`, repeatable, and the `name: key` lines of `--api-keys-file`) guard every
route but the probes (the admin key is accepted too), which stay open as in SGLang so that load
balancers and Prometheus need no key. `--admin-api-key` guards the admin routes; without it they
take the user keys. Each user key is a tenant: the middleware puts the `Caller` in the request's
state, and a tenant sees only the conversations it made. The admin key, and every caller of a
server without user keys, sees them all.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from engram.server.errors import APIError, error_response

log = logging.getLogger(__name__)
PROBE_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
_TENANT_NAME_RE = re.compile(r"[A-Za-z0-9_.@-]{1,128}")


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # the name of the user key it sent; None: the admin key, or no key on an open route
    admin: bool = False

    @property
    def restricted_to(self) -> str | None:
        """The tenant whose conversations it may touch; None: every conversation."""
        return None if self.admin else self.tenant


OPEN = Caller(None)


def key_name(key: str) -> str:
    """The stable, non-secret tenant name of a bare `--api-key`."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def read_keys_file(path: str | Path) -> dict[str, str]:
    """key -> tenant name from `name: key` lines (blank lines and `#` comments skipped). ValueError
    names the line of a malformed entry, a repeated name or a repeated key (never the key)."""
    keys: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = (part.strip() for part in line.partition(":"))
        if not sep or not key or not _TENANT_NAME_RE.fullmatch(name):
            raise ValueError(f"--api-keys-file line {number}: expected `name: key` with a name of [A-Za-z0-9_.@-]")
        if key in keys:
            raise ValueError(f"--api-keys-file line {number}: its key is given twice")
        if name in keys.values():
            raise ValueError(f"--api-keys-file line {number}: the name {name!r} is given twice")
        keys[key] = name
    return keys


@dataclass(frozen=True)
class AuthConfig:
    tenant_keys: Mapping[str, str]  # user key -> tenant name
    admin_api_key: str | None
    admin_paths: frozenset[str]

    @classmethod
    def of(cls, api_keys: list[str], keys_file: str | None, admin_api_key: str | None, admin_paths: frozenset[str]) -> AuthConfig:
        keys = {key: key_name(key) for key in api_keys if key}
        if keys_file is not None:
            keys.update(read_keys_file(keys_file))
        if admin_api_key and admin_api_key in keys:
            raise ValueError("a user key is the admin key: give the admin key only as --admin-api-key")
        return cls(keys, admin_api_key, admin_paths)

    def allowed_keys(self, path: str) -> list[str]:
        """The keys that open `path`; none: it is open."""
        if path in PROBE_PATHS:
            return []
        if path in self.admin_paths and self.admin_api_key:
            return [self.admin_api_key]
        if not self.tenant_keys:
            return []
        return [*self.tenant_keys, *([self.admin_api_key] if self.admin_api_key else [])]

    def caller(self, token: str | None) -> Caller:
        """Who sent `token` (one of `allowed_keys`, or any token on an open route). On a server
        without keys everyone is an admin: every route is open to everyone there anyway."""
        if not self.tenant_keys and not self.admin_api_key:
            return Caller(None, admin=True)
        if token is None:
            return OPEN
        if self.admin_api_key and secrets.compare_digest(token.encode(), self.admin_api_key.encode()):
            return Caller(None, admin=True)
        names = [name for key, name in self.tenant_keys.items() if secrets.compare_digest(token.encode(), key.encode())]
        return Caller(names[0]) if names else OPEN


class KeyRing:
    """The auth config in force; `reload` re-reads `--api-keys-file` (on SIGHUP)."""

    def __init__(self, api_keys: list[str], keys_file: str | None, admin_api_key: str | None, admin_paths: frozenset[str]) -> None:
        self._source = (api_keys, keys_file, admin_api_key, admin_paths)
        self.config = AuthConfig.of(*self._source)

    def reload(self) -> None:
        """Swap in the file's keys; a file that cannot be read keeps the keys in force (logged)."""
        try:
            self.config = AuthConfig.of(*self._source)
        except (OSError, ValueError) as e:
            log.error("API keys not reloaded, the previous ones stay in force: %s", e)
            return
        log.info("API keys reloaded: %d tenant keys", len(self.config.tenant_keys))


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def caller_of(request: Request) -> Caller:
    caller: Caller = request.scope.get("state", {}).get("caller", OPEN)
    return caller


def caller_is_admin(request: Request) -> bool:
    """Whether the caller may see what only admins see (server paths, every tenant's ids)."""
    return caller_of(request).admin


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: KeyRing) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            config = self.keys.config
            allowed = config.allowed_keys(scope["path"])
            token = _bearer(scope)
            if allowed and not (token and any(secrets.compare_digest(token.encode(), k.encode()) for k in allowed)):
                message = "missing API key" if token is None else "invalid API key"
                response = error_response(APIError(401, f"{message}: send `Authorization: Bearer <key>`", code="invalid_api_key"))
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["caller"] = config.caller(token)
        await self.app(scope, receive, send)
