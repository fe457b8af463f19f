"""A replica fleet on loopback, for tests/test_scale_out.py and benchmarks/scale_bench.py: moto's
S3 server in this process, and nginx running deploy/nginx-engram.conf in front of `engram serve`
replicas (server_utils.ServerProcess)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from server_utils import ServerProcess, free_port

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "nginx-engram.conf"


class S3Server:
    """moto's S3 in this process, stoppable and restartable on its port (its buckets live on)."""

    def __init__(self, in_process: bool = True) -> None:
        """`in_process` False: moto in a process of its own (no GIL shared with this one's clients),
        which cannot be restarted with its buckets."""
        self.port = free_port()
        self.in_process = in_process
        self.server: Any = None  # moto.server.ThreadedMotoServer, imported on start (moto is optional), or its Popen

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
            "AWS_ALLOW_HTTP": "true",
        }

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client(
            "s3", endpoint_url=self.env["AWS_ENDPOINT_URL"], region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test"
        ).create_bucket(Bucket=name)

    def start(self) -> None:
        if not self.in_process:
            self.server = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            wait_for(f"http://127.0.0.1:{self.port}/moto-api/", "moto")
            return
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        if self.in_process:
            self.server.stop()
        else:
            self.server.kill()
            self.server.wait()


def nginx_config(folder: Path, port: int, replicas: list[ServerProcess]) -> Path:
    """deploy/nginx-engram.conf with these replicas and port, inside a main file of its own (every
    temporary folder in `folder`: a packaged nginx's compiled-in ones may not exist)."""
    site = CONFIG.read_text()
    servers = "".join(f"    server 127.0.0.1:{r.port} max_fails=1 fail_timeout=10s;\n" for r in replicas)
    site, count = re.subn(r"(    server engram-\d+:30000 [^\n]*\n)+", servers, site)
    assert count == 1 and "listen 8080;" in site
    (folder / "site.conf").write_text(site.replace("listen 8080;", f"listen 127.0.0.1:{port};"))
    user = "user root;\n" if os.geteuid() == 0 else ""
    main = (
        f"{user}worker_processes 1;\npid {folder}/nginx.pid;\nerror_log {folder}/error.log warn;\nevents {{}}\n"
        f"http {{\n  access_log off;\n"
        + "".join(f"  {kind}_temp_path {folder}/{kind};\n" for kind in ("client_body", "proxy", "fastcgi", "scgi", "uwsgi"))
        + f"  include {folder}/site.conf;\n}}\n"
    )
    (folder / "nginx.conf").write_text(main)
    return folder / "nginx.conf"


def start_nginx(nginx: str, folder: Path, port: int, replicas: list[ServerProcess]) -> subprocess.Popen:
    """nginx on `port` in front of `replicas`, once it answers /health."""
    proc = subprocess.Popen(
        [nginx, "-p", str(folder), "-c", str(nginx_config(folder, port, replicas)), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "nginx.out", "wb"),
    )
    try:
        wait_for(f"http://127.0.0.1:{port}/health", f"nginx ({folder / 'nginx.out'})")
    except RuntimeError as e:
        proc.kill()
        raise RuntimeError(f"{e}: {(folder / 'nginx.out').read_text()[-2000:]}") from None
    return proc


def wait_for(url: str, what: str, timeout_s: float = 20.0) -> None:
    """Until `url` answers 200; RuntimeError naming `what` if it does not in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer within {timeout_s:g} s")
