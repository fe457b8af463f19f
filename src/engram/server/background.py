"""A uvicorn server on a background thread, for tests, notebooks and benchmarks.
For example:

    with BackgroundServer(app) as server:
        httpx.get(server.url + "/health")
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

# asyncio's own loop even where uvloop is installed (uvicorn would pick it): under uvloop the
# connection that carried a 503 from a failed turn record is reset, and the next request on it fails
# (tests/test_server_conversations.py, the storage-failure test).
UVICORN_LOOP = "asyncio"


class BackgroundServer:
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", wait_ready: bool = True) -> None:
        """`wait_ready`: enter once the server has warmed up (`/health` would answer 200), not only listens."""
        self.app = app
        self.wait_ready = wait_ready
        self._socket = socket.create_server((host, port))  # port 0: a free one, held from now on
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, loop=UVICORN_LOOP))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not (self._server.started and (not self.wait_ready or self.app.state.serving.startup.status != "warming")):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._socket.close()
