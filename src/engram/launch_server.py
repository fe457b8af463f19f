"""Start the HTTP server: `engram serve`, `python -m engram serve` or `python -m engram.launch_server`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING

from engram.args import (
    EngineArgs,
    ServerArgs,
    add_dataclass_args,
    add_predecessor_args,
    apply_predecessor_args,
    from_namespace,
)

if TYPE_CHECKING:
    from fastapi import FastAPI


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, EngineArgs)
    add_dataclass_args(parser, ServerArgs)
    add_predecessor_args(parser)


def build_app(engine_args: EngineArgs, server_args: ServerArgs) -> FastAPI:
    """Load the engine (a built-in model by name, or the default one when no --model-path is given) and wrap it in the app."""
    from engram.engine.async_engine import AsyncEngine
    from engram.engine.engine import LLMEngine
    from engram.models.builtin import resolve_model
    from engram.server.app import create_app

    model = resolve_model(engine_args.model_path)
    engine_args = dataclasses.replace(engine_args, model_path=model.path)
    server_args = dataclasses.replace(server_args, served_model_name=server_args.served_model_name or model.served_name)
    return create_app(AsyncEngine(LLMEngine(engine_args)), server_args)


def serve(engine_args: EngineArgs, server_args: ServerArgs) -> None:
    """Exits with status 2 and one line, not a traceback, when the model's folder, the snapshot folder's state or the snapshot store stops the start."""
    import uvicorn

    from engram.engine.spec_config import SpeculativeConfigError
    from engram.models.spec import ConfigError
    from engram.server.background import UVICORN_LOOP
    from engram.server.startup import banner
    from engram.state.health import QuarantineListError
    from engram.state.object_store import StoreConfigError

    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(engine_args, server_args)
    except (ConfigError, QuarantineListError, SpeculativeConfigError, StoreConfigError) as e:
        print(f"engram serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.getLogger("engram.server").info(banner(app.state.serving, server_args, f"http://{server_args.host}:{server_args.port}"))
    uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level, loop=UVICORN_LOOP)


def run(ns: argparse.Namespace) -> None:
    apply_predecessor_args(ns)
    try:
        server_args = from_namespace(ServerArgs, ns)
    except ValueError as e:  # a flag's value ServerArgs refuses: one line, not a traceback
        print(f"engram serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    serve(from_namespace(EngineArgs, ns), server_args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engram.launch_server", description=__doc__)
    add_server_args(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
