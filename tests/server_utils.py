"""A real server on a free loopback port: in this process (`running_server`) or as a child
process of `python -m engram serve` (`ServerProcess`), for the HTTP tests, scripts and benchmarks."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engram.args import EngineArgs, ServerArgs
from engram.launch_server import build_app
from engram.server.background import BackgroundServer


@contextlib.contextmanager
def running_server(
    model_path: str, model_name: str, engine_fields: Mapping[str, object] | None = None, **server_fields
) -> Iterator[BackgroundServer]:
    """Prefix caching is off unless asked for: the tests' reference requests (a full prefill to
    compare a restored state with) must not be served from an earlier request's state."""
    fields = {"max_running_requests": 4, "max_total_tokens": 8192, "context_length": 1024, **(engine_fields or {})}
    engine_args = EngineArgs(model_path=str(model_path), **fields)  # type: ignore[arg-type]
    server_fields.setdefault("enable_prefix_caching", False)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """`python -m engram serve <args>` on a free port, its stdout and stderr appended to `log_path`
    (a file, not a pipe: a pipe nobody reads fills up and stalls the server's logging)."""

    args: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None  # added to this process's environment
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    launcher: Sequence[str] = ()  # a command the interpreter runs under, e.g. ("taskset", "-c", "0")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout_s: float = 120.0) -> float:
        """Start it and wait until /health answers 200 (503 while it warms up); the seconds that
        took. RuntimeError with the log's tail if it exits first or is not ready in time."""
        started = time.monotonic()
        cmd = [*self.launcher, sys.executable, "-m", "engram", "serve", "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})})
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - started
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"the server was not ready within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL (if still running), and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, sig: signal.Signals = signal.SIGINT, timeout_s: float = 120.0) -> int:
        """Send `sig` (SIGINT: uvicorn's graceful shutdown) and wait; its exit status."""
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)
