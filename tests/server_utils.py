"""A real server on a free loopback port, for the HTTP tests."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from engram.args import EngineArgs, ServerArgs
from engram.launch_server import build_app
from engram.server.background import BackgroundServer


@contextlib.contextmanager
def running_server(model_path: str, model_name: str, **server_fields) -> Iterator[BackgroundServer]:
    engine_args = EngineArgs(model_path=str(model_path), max_running_requests=4, max_total_tokens=8192, context_length=1024)
    with BackgroundServer(build_app(engine_args, ServerArgs(served_model_name=model_name, **server_fields))) as srv:
        yield srv


def openai_client(url: str):
    """The official client of the /v1 routes of the server at `url` (no retries: a test sees every failure)."""
    import openai

    return openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one series of a /metrics page, by its name and labels."""
    series = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    return float(re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE).group(1))
