"""Throughput through the router: the same closed-loop chat workload through nginx
(deploy/nginx-engram.conf) in front of 1 and then 2 `engram serve` replicas sharing moto's S3
(--snapshot-store s3://...), each replica pinned to one CPU core (taskset) and one torch thread.

    python benchmarks/scale_bench.py --out benchmarks/results/scale_cpu.json

Workload: `--conversations` clients, each a conversation of `--turns` turns of `--max-tokens`
greedy tokens (ignore_eos), all at once; throughput = completion tokens / wall seconds. Every
replica answers one request before the clock starts. Prints both figures and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet_utils import S3Server, start_nginx  # noqa: E402
from serve_bench import cpu_seconds  # noqa: E402
from server_utils import ServerProcess, free_port  # noqa: E402

WORDS = "the state of a conversation is kept exactly and restored so a turn costs only its new tokens".split()


def replica(folder: Path, index: int, store: S3Server, bucket: str, a: argparse.Namespace) -> ServerProcess:
    flags = ["--model-path", a.model_path] if a.model_path else []
    flags += [
        "--served-model-name",
        "m",
        "--snapshot-store",
        f"s3://{bucket}/bench",
        "--snapshot-dir",
        str(folder / f"cache{index}"),
        "--no-enable-prefix-caching",
        "--log-level",
        "warning",
    ]
    env = {**store.env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # a CPU workload, GPU or not
    pinned = ("taskset", "-c", str(index % (os.cpu_count() or 1))) if shutil.which("taskset") else ()  # one core each
    return ServerProcess(flags, folder / f"replica{index}.log", env=env, launcher=pinned)


async def conversation(http: httpx.AsyncClient, cid: str, a: argparse.Namespace, served: Counter) -> int:
    tokens = 0
    for t in range(a.turns):
        text = f"turn {t} of {cid}: " + " ".join(WORDS[(t + i) % len(WORDS)] for i in range(a.message_words))
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": text}],
            "conversation_id": cid,
            "temperature": 0,
            "max_tokens": a.max_tokens,
            "ignore_eos": True,
        }
        r = await http.post("/v1/chat/completions", json=body, headers={"X-Conversation-Id": cid, "Idempotency-Key": f"{cid}-{t}"})
        r.raise_for_status()
        tokens += r.json()["usage"]["completion_tokens"]
        served[r.headers["X-Engram-Upstream"]] += 1
    return tokens


async def workload(router: str, a: argparse.Namespace, tag: str) -> dict:
    async with httpx.AsyncClient(base_url=router, timeout=600, limits=httpx.Limits(max_connections=a.conversations)) as http:
        served: Counter = Counter()
        started = time.perf_counter()
        counts = await asyncio.gather(*(conversation(http, f"{tag}-{i}", a, served) for i in range(a.conversations)))
        wall = time.perf_counter() - started
    return {
        "completion_tokens": sum(counts),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(counts) / wall, 2),
        "turns_per_s": round(a.conversations * a.turns / wall, 3),
        "turns_per_replica": sorted(served.values()),
    }


def run(count: int, a: argparse.Namespace, store: S3Server, folder: Path) -> dict:
    bucket = f"engram-bench-{count}"
    store.create_bucket(bucket)
    replicas = [replica(folder, i, store, bucket, a) for i in range(count)]
    nginx = None
    try:
        for r in replicas:
            r.start()
        for r in replicas:  # every replica warm before the clock starts
            httpx.post(
                r.url + "/v1/chat/completions",
                timeout=600,
                json={"model": "m", "messages": [{"role": "user", "content": "warm"}], "max_tokens": a.max_tokens},
            ).raise_for_status()
        port = free_port()
        nginx = start_nginx(a.nginx, folder, port, replicas)
        processes = [*replicas, store.server, nginx]  # each has a pid; cpu_seconds reads /proc/<pid>
        before = [cpu_seconds(p)[0] for p in processes], resource.getrusage(resource.RUSAGE_SELF)
        row = asyncio.run(workload(f"http://127.0.0.1:{port}", a, f"r{count}"))
        after = [cpu_seconds(p)[0] for p in processes], resource.getrusage(resource.RUSAGE_SELF)
        # Cores busy on average over the run: each replica, moto's S3, nginx, and this process (the clients).
        cores = [round((b - a0) / row["wall_s"], 2) for a0, b in zip(before[0], after[0])]
        row["replica_cores"], (row["store_cores"], row["nginx_cores"]) = cores[:count], cores[count:]
        row["client_cores"] = round((after[1].ru_utime + after[1].ru_stime - before[1].ru_utime - before[1].ru_stime) / row["wall_s"], 2)
        return {"replicas": count, **row}
    finally:
        if nginx is not None:
            nginx.kill()
            nginx.wait()
        for r in replicas:
            if r.proc is not None:
                r.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the built-in demo model")
    p.add_argument("--conversations", type=int, default=64, help="clients at once (enough for the hash ring to split them evenly)")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--message-words", type=int, default=150, help="words per user message: the prompt tokens each turn prefills")
    p.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    store = S3Server(in_process=False)  # its own process: no GIL shared with the clients
    store.start()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(n, a, store, Path(tmp)) for n in (1, 2)]
    store.stop()
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    for row in rows:
        print(
            f"{row['replicas']} replica(s): {row['tokens_per_s']:8.1f} tok/s  {row['turns_per_s']:6.2f} turns/s  ({row['wall_s']} s, turns per replica {row['turns_per_replica']}, cores busy: replicas {row['replica_cores']}, store {row['store_cores']}, nginx {row['nginx_cores']}, clients {row['client_cores']})"
        )
    print(f"2 replicas / 1 replica: {ratio:.2f}x")
    result = {
        "rows": rows,
        "ratio": round(ratio, 3),
        "args": {k: v for k, v in vars(a).items() if k != "out"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    }
    if a.out is not None:
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
