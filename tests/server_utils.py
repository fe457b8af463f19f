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
    """Prefix caching is off unless asked for: the tests' reference requests (a full prefill to
    compare a restored state with) must not be served from an earlier request's state."""
    engine_args = EngineArgs(model_path=str(model_path), max_running_requests=4, max_total_tokens=8192, context_length=1024)
    server_fields.setdefault("enable_prefix_caching", False)
    with BackgroundServer(build_app(engine_args, ServerArgs(served_model_name=model_name, **server_fields))) as srv:
        yield srv


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one series of a /metrics page, by its name and labels."""
    series = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    return float(re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE).group(1))
