"""`Runtime`: a server in a child process, started from keyword arguments, as `sgl.Runtime` does
for the SGLang-based predecessor's users:

    with Runtime(model_path="/models/granite", enable_snapshot_persistence=True) as runtime:
        SnapshotManager(runtime.endpoint).list_conversation("session-1")

The keywords are the `engram serve` flags' names (`max_running_requests=4` is
`--max-running-requests 4`; a bool gives `--x` or `--no-x`). Imports no torch: the child loads the model.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from engram.args import REFUSED_FLAGS, EngineArgs, PredecessorArgs, ServerArgs
from engram.client import EngramClient

FLAG_FIELDS = frozenset(f.name for cls in (EngineArgs, ServerArgs, PredecessorArgs) for f in dataclasses.fields(cls))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_argv(**fields: Any) -> list[str]:
    """The `python -m engram.launch_server` arguments for these fields (None: left at its default)."""
    argv: list[str] = []
    for name, value in fields.items():
        if name in REFUSED_FLAGS:
            raise ValueError(f"{name} (an argument of the SGLang-based predecessor) is not supported: {REFUSED_FLAGS[name]}")
        if name not in FLAG_FIELDS:
            raise TypeError(f"Runtime() got an unexpected keyword argument {name!r} (not an `engram serve` flag)")
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def wait_until_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Return once `url`/health answers 200; `RuntimeError` if the process exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not answer /health within {timeout:g} s")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


class Runtime:
    """An Engram server process: `.url`, `.endpoint` (an `EngramClient` of it, which `SnapshotManager`
    takes), `.shutdown()`. The constructor returns once /health answers 200; a child that exits
    first, or no answer within `timeout` seconds, raises `RuntimeError` with the child's output."""

    def __init__(self, timeout: float = 600.0, **fields: Any):
        fields.setdefault("host", "127.0.0.1")
        if fields.get("port") is None:
            fields["port"] = free_port(fields["host"])
        self.url = f"http://{fields['host']}:{fields['port']}"
        self._log = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, "-m", "engram.launch_server", *server_argv(**fields)]
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_until_healthy(self.url, self.process, timeout)
        except RuntimeError as e:
            output = self.output()
            self.shutdown()
            raise RuntimeError(f"{e}:\n{output}") from None
        except BaseException:
            self.shutdown()
            raise
        self.endpoint = EngramClient(self.url, self._key(fields))

    @staticmethod
    def _key(fields: dict[str, Any]) -> str | None:
        """The admin key if any (it opens every route), else the first API key."""
        keys = fields.get("api_key") or []
        return fields.get("admin_api_key") or ([keys] if isinstance(keys, str) else keys or [None])[0]

    def output(self) -> str:
        """What the server process has printed so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the server as Ctrl-C does (it writes the states only memory holds), then kill it
        if it has not exited within `timeout` seconds."""
        if hasattr(self, "endpoint"):
            self.endpoint.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # uvicorn's graceful stop
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
