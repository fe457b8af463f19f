"""The app factory: routes, error handlers and auth around one `AsyncEngine`.

The app owns the engine's loop thread: it starts with the app and stops with it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from engram.args import ServerArgs
from engram.engine.async_engine import AsyncEngine
from engram.server import embedding_routes, native_routes, openai_routes, snapshot_routes, startup, transfer_routes
from engram.server.auth import AuthMiddleware, KeyRing
from engram.server.body_limit import BodyLimitMiddleware
from engram.server.chat_reply import ReplyParsers
from engram.server.conversations import ConversationTurns, build_manager, run_maintenance
from engram.server.errors import install_error_handlers
from engram.server.serving import Serving
from engram.server.transfer_routes import IMPORT_PATH

log = logging.getLogger(__name__)


def _reload_keys_on_sighup(keys: KeyRing) -> bool:
    """Re-read --api-keys-file on SIGHUP (possible only when the server runs in the main thread)."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        log.warning("--api-keys-file is read once: SIGHUP can reload it only when the server runs in the main thread")
        return False
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, keys.reload)
    return True


def _paths(router: APIRouter) -> list[str]:
    """The paths of the router's routes: every one an API route, else it would go unguarded."""
    routes = [route for route in router.routes if isinstance(route, APIRoute)]
    if len(routes) != len(router.routes):
        raise TypeError(f"an admin router holds a route without a path for the admin key to guard: {router.routes}")
    return [route.path for route in routes]


def create_app(engine: AsyncEngine, args: ServerArgs) -> FastAPI:
    manager = build_manager(engine.engine, args)
    admin_routers = (native_routes.admin_router, snapshot_routes.admin_router)
    admin_paths = frozenset(path for router in admin_routers for path in _paths(router))
    keys = KeyRing(args.api_key, args.api_keys_file, args.admin_api_key, admin_paths)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        await asyncio.to_thread(manager.preload, args.snapshot_preload)
        maintenance = asyncio.create_task(run_maintenance(manager, engine))
        warming = asyncio.create_task(startup.warm_up(app.state.serving, args.enable_warmup))
        reloading = args.api_keys_file is not None and _reload_keys_on_sighup(keys)
        try:
            yield
        finally:
            if reloading:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            warming.cancel()
            maintenance.cancel()
            await asyncio.to_thread(manager.close, args.shutdown_snapshot_timeout)  # flush, write what only memory holds
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Engram", lifespan=lifespan)
    turns = ConversationTurns(manager, engine.engine.tokenizer, cross_session_refs=args.enable_cross_session_refs)
    replies = ReplyParsers(args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser)
    app.state.serving = Serving(engine, args.served_model_name or engine.engine.model_path.name, turns, replies)
    app.state.server_args = args
    install_error_handlers(app)
    for router in (
        openai_routes.router,
        embedding_routes.router,
        native_routes.router,
        snapshot_routes.router,
        transfer_routes.router,
        *admin_routers,
    ):
        app.include_router(router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_bytes, larger={IMPORT_PATH: args.max_import_bytes})
    app.add_middleware(AuthMiddleware, keys=keys)  # outermost: first
    return app
