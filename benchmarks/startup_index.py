"""Server start-up time with no saved conversations and with many: the snapshot folder is indexed
lazily, so start-up reads none of them.

Makes one real conversation on the embedded model, copies its folder N times, then times, for an
empty snapshot folder and for the full one: building the app (engine included) and the first
continuation of one saved conversation.

    python benchmarks/startup_index.py --conversations 10000
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from engram.args import EngineArgs, ServerArgs
from engram.launch_server import build_app
from engram.models.embedded import ensure_embedded_model
from engram.server.background import BackgroundServer

MODEL = "m"


def chat(url: str, conversation_id: str, text: str) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "conversation_id": conversation_id, "max_tokens": 4}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    return r.json()


def start_and_continue(model: Path, snapshots: Path) -> tuple[float, float]:
    started = time.perf_counter()
    app = build_app(EngineArgs(model_path=str(model)), ServerArgs(served_model_name=MODEL, snapshot_dir=str(snapshots)))
    with BackgroundServer(app) as server:
        up = time.perf_counter() - started
        started = time.perf_counter()
        reply = chat(server.url, "c0", "again")
        first = time.perf_counter() - started
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    return up, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=10000)
    args = parser.parse_args()
    model = ensure_embedded_model()
    with tempfile.TemporaryDirectory() as tmp:
        few, many = Path(tmp) / "one", Path(tmp) / "many"
        app = build_app(EngineArgs(model_path=str(model)), ServerArgs(served_model_name=MODEL, snapshot_dir=str(few)))
        with BackgroundServer(app) as server:
            chat(server.url, "c0", "hello")
        for i in range(args.conversations):
            shutil.copytree(few / "c0", many / f"c{i}")
        files = sum(1 for _ in many.rglob("*.safetensors"))
        for label, folder in (("1 conversation", few), (f"{args.conversations} conversations ({files} snapshot files)", many)):
            up, first = start_and_continue(model, folder)
            print(f"| {label} | {up * 1000:.0f} | {first * 1000:.0f} |", flush=True)


if __name__ == "__main__":
    main()
