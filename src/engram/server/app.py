"""The app factory: routes, error handlers and auth around one `AsyncEngine`.

The app owns the engine's loop thread: it starts with the app and stops with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engram.args import ServerArgs
from engram.engine.async_engine import AsyncEngine
from engram.server import native_routes, openai_routes
from engram.server.auth import AuthConfig, AuthMiddleware
from engram.server.errors import install_error_handlers
from engram.server.serving import Serving


def create_app(engine: AsyncEngine, args: ServerArgs) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Engram", lifespan=lifespan)
    app.state.serving = Serving(engine, args.served_model_name or engine.engine.model_path.name)
    install_error_handlers(app)
    for router in (openai_routes.router, native_routes.router, native_routes.admin_router):
        app.include_router(router)
    admin_paths = frozenset(route.path for route in native_routes.admin_router.routes)
    app.add_middleware(AuthMiddleware, config=AuthConfig(args.api_key, args.admin_api_key, admin_paths))
    return app
