"""The product against the engine: `engram serve` driven over HTTP by an OpenAI client, then the
same workloads on the in-process engine (after the server has stopped: they never share the
device), each HTTP figure beside its in-process ratio. One run.

    python benchmarks/serve_bench.py --config granite-4.0-h-tiny --out serve_h200.json
    python benchmarks/serve_bench.py --config granite-4.0-h-tiny --tiny --out serve_cpu.json  # a CPU, minutes

Random weights from a config (tests/data/configs or ../shared/configs), saved once per config hash
with `save_pretrained` (bfloat16 on CUDA, float32 on CPU) beside a byte-level tokenizer padded to
the model's vocabulary (every token has text, so every token is one streamed chunk).
Workloads:
  fixed     N clients in a closed loop, fixed prompt and output lengths (ignore_eos), spread over
            --client-procs processes (one Python event loop streams only a few thousand tokens a
            second): output tok/s, TTFT, ITL, E2E p50/p99; then a Poisson request-rate sweep with
            mixed lengths;
  chats     users x turns on top of a history of H tokens by conversation_id (server-side state),
            the same resending the whole history without conversation_id, and one more turn each
            after a server restart (cold restore); TTFT per kind, and the server's snapshot write
            time per turn beside the (sync durability) turn latency;
  engine    the fixed and chat workloads on the in-process engine (LLMEngine steps, warmed up).
The run fails (exit 1) if the server compiled or captured anything after it said ready.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import multiprocessing
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from bench_speed import find_config, rand_tokens
from restore_latency import CPU_SCALE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_utils import ServerProcess

from engram.args import EngineArgs
from engram.engine.async_engine import AsyncEngine
from engram.engine.engine import LLMEngine
from engram.engine.request import SamplingParams
from engram.models.byte_tokenizer import build_byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench"
# --tiny: a Granite-4.0-H-shaped model a CPU serves in a couple of minutes.
TINY = {
    **CPU_SCALE,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "attention"],
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "shared_intermediate_size": 128,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "mamba_n_heads": 8,
    "mamba_d_head": 32,
    "mamba_d_state": 16,
    "vocab_size": 1024,
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the checkpoint ----------------------------------------------------------------------------


def build_checkpoint(config: dict, device: str, cache: Path) -> Path:
    """Random weights for `config`, written once per (config, dtype) and reused."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    key = hashlib.sha256(json.dumps([config, dtype], sort_keys=True).encode()).hexdigest()[:16]
    path = cache / f"serve_bench-{key}"
    if (path / "config.json").exists():
        return path
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_byte_tokenizer(config["vocab_size"])
    config = {**config, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id}
    tmp = Path(tempfile.mkdtemp(dir=cache))
    (tmp / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp), dtype=getattr(torch, dtype))
    model.save_pretrained(tmp)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the server and the in-process engine plan their memory from what is free
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(path)
    return path


# ---- the server ----------------------------------------------------------------------------------


READY_TIMEOUT_S = 1800  # compiling and capturing on a GPU take minutes


def metric(server: ServerProcess, name: str, label: str = "") -> float:
    """The sum of a metric's series (those whose labels include `label`)."""
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") and label in line)


RESEND_TIERS = {  # where a resent history's reuse came from: (metric, label)
    "gpu_slot_hits": ("engram:prefix_cache_slot_hits_total", ""),
    "host_or_disk_hits": ("engram:prefix_cache_queries_total", 'result="hit"'),
    "disk_hits": ("engram:prefix_cache_disk_hits_total", ""),
    "cached_tokens": ("engram:cached_tokens_total", ""),
}
SERVER_MEANS = {"server_ttft_mean": "engram:time_to_first_token_seconds", "server_queue_mean": "engram:request_queue_time_seconds"}


def server_means(server: ServerProcess, before: dict[str, float] | None = None) -> dict[str, float | None]:
    """The server's histograms' sums and counts (`before` None), or their means since `before`."""
    now = {f"{name}_{x}": metric(server, f"{name}_{x}") for name in SERVER_MEANS.values() for x in ("sum", "count")}
    if before is None:
        return now
    delta = {k: v - before[k] for k, v in now.items()}
    return {key: delta[f"{name}_sum"] / delta[f"{name}_count"] if delta[f"{name}_count"] else None for key, name in SERVER_MEANS.items()}


def cpu_seconds(server: ServerProcess) -> tuple[float, float]:
    """User + system CPU time so far (Linux /proc) of the server process, and of its main thread
    alone: the event loop (HTTP, SSE, the routes), which the engine thread shares the GIL with."""

    def cpu(stat: Path) -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    proc = Path(f"/proc/{server.pid}")
    return cpu(proc / "stat"), cpu(proc / "task" / str(server.pid) / "stat")


# ---- statistics ----------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else None


def summary(ttft: list[float], itl: list[float], e2e: list[float], tokens: int, wall: float) -> dict:
    return {
        "requests": len(e2e),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        **{f"{name}_p{q}": pct(xs, q) for name, xs in (("ttft", ttft), ("itl", itl), ("e2e", e2e)) for q in (50, 99)},
    }


@dataclass
class Timing:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tokens: int = 0

    def add(self, start: float, token_times: list[float], tokens: int | None = None) -> None:
        """`token_times`: when each chunk with text came; `tokens`: the tokens generated, when some
        came without text (a random model may repeat a lone byte of a UTF-8 sequence)."""
        self.ttft.append(token_times[0] - start)
        self.itl += [b - a for a, b in itertools.pairwise(token_times)]
        self.e2e.append(token_times[-1] - start)
        self.tokens += len(token_times) if tokens is None else tokens


# ---- HTTP workloads ------------------------------------------------------------------------------


async def stream_completion(client, prompt: list[int], max_tokens: int, timing: Timing) -> None:
    """One streamed request; tokens counted by the usage chunk, times by the chunks (the finishing
    one stands for a reply without text)."""
    start = time.perf_counter()
    times, tokens = [], 0
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and (chunk.choices[0].text or (not times and chunk.choices[0].finish_reason)):
            times.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    timing.add(start, times, tokens)


async def http_fixed(client, concurrency: int, requests: list[int], prompt_len: int, output_len: int, vocab: int) -> Timing:
    """`concurrency` closed-loop clients on one event loop, taking the `requests` (prompt seeds) in turn."""
    timing, queue = Timing(), list(requests)

    async def worker() -> None:
        while queue:
            i = queue.pop()
            await stream_completion(client, rand_tokens(prompt_len, vocab, 10_000 + i), output_len, timing)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timing


def fixed_share(url: str, concurrency: int, requests: list[int], prompt_len: int, output_len: int, vocab: int, start_at: float) -> dict:
    """One client process's share of a fixed workload (run in a process pool): its timings, when
    it started and ended (perf_counter is one clock for every process of a Linux machine) and its CPU."""
    from openai import AsyncOpenAI

    async def go() -> tuple[Timing, float, float]:
        client = AsyncOpenAI(base_url=url, api_key="none", timeout=3600, max_retries=0)
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        started = time.perf_counter()
        timing = await http_fixed(client, concurrency, requests, prompt_len, output_len, vocab)
        ended = time.perf_counter()
        await client.close()
        return timing, started, ended

    cpu = time.process_time()
    timing, started, ended = asyncio.run(go())
    return {"timing": timing, "started": started, "ended": ended, "cpu_s": time.process_time() - cpu}


async def http_fixed_procs(pool: ProcessPoolExecutor, procs: int, url: str, concurrency: int, requests: int, a, vocab: int) -> tuple[dict, float]:
    """A fixed workload spread over `procs` client processes (one Python event loop streams only a
    few thousand tokens a second: the client must not be what is measured): its summary and the
    clients' CPU seconds."""
    procs = max(1, min(procs, concurrency))
    loop = asyncio.get_running_loop()
    start_at = time.perf_counter() + 1.0  # every process connected and waiting
    shares = await asyncio.gather(
        *(
            loop.run_in_executor(
                pool,
                fixed_share,
                url,
                concurrency // procs + (p < concurrency % procs),
                list(range(p, requests, procs)),
                a.prompt_len,
                a.output_len,
                vocab,
                start_at,
            )
            for p in range(procs)
        )
    )
    timing = Timing()
    for share in shares:
        t = share["timing"]
        timing.ttft += t.ttft
        timing.itl += t.itl
        timing.e2e += t.e2e
        timing.tokens += t.tokens
    wall = max(sh["ended"] for sh in shares) - min(sh["started"] for sh in shares)
    return summary(timing.ttft, timing.itl, timing.e2e, timing.tokens, wall), sum(sh["cpu_s"] for sh in shares)


def mixed_lengths(n: int, prompt_len: int, output_len: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(max(1, prompt_len // 4), 2 * prompt_len), rng.randint(max(1, output_len // 4), 2 * output_len)) for _ in range(n)]


async def http_rate(client, rate: float, lengths: list[tuple[int, int]], vocab: int) -> dict:
    timing, rng = Timing(), random.Random(int(rate * 1000))
    started = time.perf_counter()
    tasks = []
    for i, (p, o) in enumerate(lengths):
        tasks.append(asyncio.create_task(stream_completion(client, rand_tokens(p, vocab, 20_000 + i), o, timing)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return {"rate": rate, **summary(timing.ttft, timing.itl, timing.e2e, timing.tokens, time.perf_counter() - started)}


TEXT_CHARS = "abcdefghij klmnopqrstuvwxyz"
# A reply's tokens: these characters only, so that a reply's text encodes again to the tokens that
# were generated (as a real model's text does; a random model's bytes may not be UTF-8), and a
# client that resends it can find the previous turn's state.
REPLY_TOKENS = build_byte_tokenizer().encode(TEXT_CHARS, add_special_tokens=False)


def history_text(tokens: int, seed: int) -> str:
    """Text of `tokens` byte-tokenizer tokens (printable ASCII, one token a byte)."""
    rng = random.Random(seed)
    return "".join(rng.choice(TEXT_CHARS) for _ in range(tokens))


async def chat_turn(client, messages: list[dict], reply_len: int, conversation_id: str | None, timing: Timing) -> str:
    start = time.perf_counter()
    times, text = [], []
    extra = {"ignore_eos": True, "allowed_token_ids": REPLY_TOKENS, **({"conversation_id": conversation_id} if conversation_id else {})}
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=reply_len, temperature=0, stream=True, extra_body=extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        elif chunk.choices and chunk.choices[0].finish_reason and not times:  # a reply without text
            times.append(time.perf_counter())
    timing.add(start, times)
    return "".join(text)


async def http_chats(client, a, prefix: str, resend: bool, server: ServerProcess) -> tuple[Timing, Timing, list[float]]:
    """users x turns, one user at a time as `engine_chats` runs them (so that the ratio compares one
    workload, not a turn queued behind another user's history prefill); the first turn carries the
    history. Returns (first turns, later turns, the snapshot bytes each later turn wrote)."""
    first, later, later_bytes = Timing(), Timing(), []
    for u in range(a.users):
        messages: list[dict] = []
        for t in range(a.turns):
            content = history_text(a.history, u) if t == 0 else history_text(a.turn_len, 1000 * u + t)
            new = [{"role": "user", "content": content}]
            sent = messages + new if resend else new
            written = snapshot_writes(server)["bytes"]
            reply = await chat_turn(client, sent, a.reply_len, None if resend else f"{prefix}{u}", first if t == 0 else later)
            if t:
                later_bytes.append(snapshot_writes(server)["bytes"] - written)
            messages += [*new, {"role": "assistant", "content": reply}]
    return first, later, later_bytes


async def http_after_restart(client, a, prefix: str) -> Timing:
    """One more turn of each user's conversation, one at a time: each a cold restore from disk."""
    timing = Timing()
    for u in range(a.users):
        await chat_turn(client, [{"role": "user", "content": history_text(a.turn_len, 7 + u)}], a.reply_len, f"{prefix}{u}", timing)
    return timing


def chat_row(t: Timing) -> dict:
    return summary(t.ttft, t.itl, t.e2e, t.tokens, max(sum(t.e2e), 1e-9))


def snapshot_writes(server: ServerProcess) -> dict:
    """Snapshot writes so far: count and seconds, and the bytes the store wrote."""
    stats = httpx.get(server.url + "/v1/state/stats").json()
    return {**stats["snapshot_write_seconds"], "bytes": (stats["store"] or {}).get("bytes_written", 0)}


async def http_chat_workloads(a, server: ServerProcess, client, out: dict):
    """The chats by conversation_id, resending the history, then one turn each after a restart.
    Closes `client`; returns the client of the restarted server."""
    from openai import AsyncOpenAI

    writes_before = snapshot_writes(server)
    first, later, later_bytes = await http_chats(client, a, "u", resend=False, server=server)
    writes = snapshot_writes(server)
    out["chat_first"], out["chat_resumed"] = chat_row(first), chat_row(later)
    n = writes["count"] - writes_before["count"]
    out["snapshot_write_s_per_turn"] = (writes["sum"] - writes_before["sum"]) / n if n else None
    out["snapshot_bytes_per_resumed_turn"] = sum(later_bytes) / len(later_bytes) if later_bytes else None
    tiers_before = {k: metric(server, *m) for k, m in RESEND_TIERS.items()}
    _, resent, _ = await http_chats(client, a, "r", resend=True, server=server)
    out["chat_resend_history"] = chat_row(resent)
    out["resend_tiers"] = {k: metric(server, *m) - tiers_before[k] for k, m in RESEND_TIERS.items()}  # where the reuse came from
    log(
        f"http chats: resumed TTFT p50 {out['chat_resumed']['ttft_p50'] * 1e3:.1f} ms, resend-history {out['chat_resend_history']['ttft_p50'] * 1e3:.1f} ms"
        f" (reuse from: {out['resend_tiers']})"
    )
    out["compilations_after_ready"] = metric(server, "engram:compilations_after_ready_total")
    out["preemptions"] = metric(server, "engram:num_preemptions_total")
    await client.close()
    server.stop()  # SIGINT: uvicorn's graceful shutdown, snapshots flushed
    out["restart_ready_s"] = server.start(READY_TIMEOUT_S)
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=3600, max_retries=0)
    out["chat_after_restart"] = chat_row(await http_after_restart(client, a, "u"))
    out["compilations_after_ready"] += metric(server, "engram:compilations_after_ready_total")
    return client


async def run_http(a, server: ServerProcess, vocab: int) -> dict:
    from openai import AsyncOpenAI

    out: dict = {"ready_s": server.start(READY_TIMEOUT_S)}
    log(f"server ready in {out['ready_s']:.1f} s")
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=3600, max_retries=0)
    first = Timing()  # the first request after ready, against the same request in fixed_c1 (warm before ready)
    await stream_completion(client, rand_tokens(a.prompt_len, vocab, 1), a.output_len, first)
    out["first_after_ready"] = summary(first.ttft, first.itl, first.e2e, first.tokens, first.e2e[0])
    procs = a.client_procs or max(1, (os.cpu_count() or 1) // 4)
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(pool, time.sleep, 2.0) for _ in range(procs)))  # every process up
        for c in a.concurrency:
            server_cpu, loop_cpu = cpu_seconds(server)
            means_before = server_means(server)
            r, client_cpu = await http_fixed_procs(pool, procs, server.url + "/v1", c, max(c * a.rounds, c), a, vocab)
            out[f"fixed_c{c}"] = r
            server_after, loop_after = cpu_seconds(server)
            r |= server_means(server, means_before)  # TTFT from its arrival, as the server sees it, and its wait for a slot
            per_token = 1e3 / r["output_tokens"]
            r["client_procs"] = min(procs, c)
            r["server_cpu_ms_per_token"] = (server_after - server_cpu) * per_token
            r["server_loop_cpu_ms_per_token"] = (loop_after - loop_cpu) * per_token
            r["client_cpu_ms_per_token"] = client_cpu * per_token
            log(
                f"http fixed c={c} ({r['client_procs']} client processes): {r['output_tok_s']:,.0f} tok/s, TTFT p50 "
                f"{r['ttft_p50'] * 1e3:.1f} ms (server's mean {ms(r['server_ttft_mean'])} ms, queued {ms(r['server_queue_mean'])} ms), "
                f"CPU per token: server {r['server_cpu_ms_per_token']:.3f} ms "
                f"(event loop {r['server_loop_cpu_ms_per_token']:.3f}), clients {r['client_cpu_ms_per_token']:.3f} ms"
            )
    lengths = mixed_lengths(a.rate_requests, a.prompt_len, a.output_len, 0)
    for rate in a.rates:
        out[f"rate_{rate:g}"] = r = await http_rate(client, rate, lengths, vocab)
        log(f"http rate {rate:g}/s: {r['output_tok_s']:,.0f} tok/s, TTFT p50 {r['ttft_p50'] * 1e3:.1f} ms")
    out["compilations_after_ready"] = metric(server, "engram:compilations_after_ready_total")
    out["preemptions"] = metric(server, "engram:num_preemptions_total")
    if a.users:
        client = await http_chat_workloads(a, server, client, out)
    await client.close()
    server.stop()
    return out


# ---- the in-process engine -------------------------------------------------------------------------


def engine_closed_loop(eng: LLMEngine, jobs: list[tuple[list[int], int]], concurrency: int) -> dict:
    """The jobs (prompt, output tokens), `concurrency` at a time, through engine steps."""
    timing, pending, live = Timing(), list(reversed(jobs)), {}
    started = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            prompt, n = pending.pop()
            rid = f"e{len(pending)}-{time.perf_counter_ns()}"
            eng.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            live[rid] = (time.perf_counter(), [])
        for out in eng.step():
            start, times = live[out.request_id]
            now = time.perf_counter()
            times += [now] * len(out.new_token_ids)
            if out.finished:
                timing.add(start, times)
                del live[out.request_id]
    return summary(timing.ttft, timing.itl, timing.e2e, timing.tokens, time.perf_counter() - started)


def engine_first_token(eng: LLMEngine, prompt: list[int], n: int, **kw) -> tuple[float, float, object]:
    rid = f"t{time.perf_counter_ns()}"
    start = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), **kw)
    first = None
    while True:
        for out in eng.step():
            if out.request_id == rid:
                first = first or time.perf_counter()
                if out.finished:
                    return first - start, time.perf_counter() - start, out


def engine_chats(eng: LLMEngine, a) -> tuple[Timing, Timing]:
    """One user at a time: the history prefilled (state kept in its slot), then turns on top of it."""
    first, later = Timing(), Timing()
    tok = eng.tokenizer
    for u in range(a.users):
        prompt = tok.encode(history_text(a.history, u), add_special_tokens=False)
        for t in range(a.turns):
            key = f"chat{u}-{t}"
            ttft, e2e, out = engine_first_token(
                eng, prompt, a.reply_len, capture_state=True, retain_key=key, **({"resume_key": f"chat{u}-{t - 1}"} if t else {})
            )
            (first if t == 0 else later).ttft.append(ttft)
            (first if t == 0 else later).e2e.append(e2e)
            prompt = out.state.tokens + tok.encode(history_text(a.turn_len, 1000 * u + t + 1), add_special_tokens=False)
        eng.release_retained(f"chat{u}-{a.turns - 1}")
    return first, later


async def async_closed_loop(engine: AsyncEngine, jobs: list[tuple[list[int], int]], concurrency: int) -> dict:
    """The jobs through `AsyncEngine` (the server's engine thread and its delivery to an event
    loop), `concurrency` consumers on this event loop: the server's path without HTTP."""
    timing, pending = Timing(), list(reversed(jobs))
    started = time.perf_counter()

    async def worker() -> None:
        while pending:
            prompt, n = pending.pop()
            start, times = time.perf_counter(), []
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            async for out in engine.generate(f"a{len(pending)}-{time.perf_counter_ns()}", prompt, params):
                times += [time.perf_counter()] * len(out.new_token_ids)
            timing.add(start, times)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summary(timing.ttft, timing.itl, timing.e2e, timing.tokens, time.perf_counter() - started)


def fixed_jobs(a, c: int, vocab: int) -> list[tuple[list[int], int]]:
    return [(rand_tokens(a.prompt_len, vocab, 10_000 + i), a.output_len) for i in range(max(c * a.rounds, c))]


def run_engine(a, engine_args: EngineArgs, vocab: int) -> dict:
    eng = LLMEngine(engine_args)
    report = eng.warm_up()
    log(f"in-process engine warmed up in {report.seconds:.1f} s")
    out = {}
    for c in a.concurrency:
        cpu = time.process_time()
        out[f"fixed_c{c}"] = r = engine_closed_loop(eng, fixed_jobs(a, c, vocab), c)
        r["cpu_ms_per_token"] = (time.process_time() - cpu) * 1e3 / r["output_tokens"]
        log(f"engine fixed c={c}: {r['output_tok_s']:,.0f} tok/s, CPU per token {r['cpu_ms_per_token']:.3f} ms")
    if a.users:
        first, later = engine_chats(eng, a)
        out["chat_first"], out["chat_resumed"] = chat_row(first), chat_row(later)
    threaded = AsyncEngine(eng)  # last: its shutdown closes the engine
    threaded.start()
    try:
        for c in a.concurrency:
            out[f"thread_c{c}"] = r = asyncio.run(async_closed_loop(threaded, fixed_jobs(a, c, vocab), c))
            log(f"engine thread + event loop c={c}: {r['output_tok_s']:,.0f} tok/s, TTFT p50 {r['ttft_p50'] * 1e3:.1f} ms")
    finally:
        threaded.shutdown()
    return out


# ---- report -------------------------------------------------------------------------------------------


def ms(x: float | None) -> str:
    return f"{x * 1e3:,.1f}" if x is not None else "-"


def ratio(h: float | None, e: float | None) -> str:
    return f"{h / e:.2f}x" if h and e else "-"


def print_tables(res: dict) -> None:
    H, E = res["http"], res.get("engine", {})
    print(f"\nmachine: {res['machine']}; commit {res['commit']}; config {res['config']}")
    print(f"command: {res['command']}\n")
    print(
        "| workload | HTTP tok/s | engine tok/s | HTTP / engine | engine thread + event loop tok/s | TTFT p50 / p99 ms (HTTP) | TTFT p50 ms (engine) | "
        "ITL p50 / p99 ms (HTTP) | "
        "E2E p50 / p99 ms (HTTP) | CPU ms/token: server (its event loop) / client / engine |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in [k for k in H if k.startswith(("fixed_", "rate_"))]:
        h, e, t = H[key], E.get(key, {}), E.get(key.replace("fixed_", "thread_"), {})

        def f(x: float | None) -> str:
            return f"{x:.3f}" if x is not None else "-"

        cpu = (
            f"{f(h.get('server_cpu_ms_per_token'))} ({f(h.get('server_loop_cpu_ms_per_token'))}) / {f(h.get('client_cpu_ms_per_token'))}"
            f" / {f(e.get('cpu_ms_per_token'))}"
        )
        print(
            f"| {key} | {h['output_tok_s']:,.0f} | {e.get('output_tok_s', 0):,.0f} | {ratio(h['output_tok_s'], e.get('output_tok_s'))} | "
            f"{t.get('output_tok_s', 0):,.0f} | "
            f"{ms(h['ttft_p50'])} / {ms(h['ttft_p99'])} | {ms(e.get('ttft_p50'))} | {ms(h['itl_p50'])} / {ms(h['itl_p99'])} | "
            f"{ms(h['e2e_p50'])} / {ms(h['e2e_p99'])} | {cpu} |"
        )
    if "chat_first" in H:
        print("\n| chat turn | TTFT p50 / p99 ms (HTTP) | TTFT p50 ms (engine) | HTTP / engine | E2E p50 / p99 ms (HTTP) |")
        print("| --- | --- | --- | --- | --- |")
        for key in ("chat_first", "chat_resumed", "chat_resend_history", "chat_after_restart"):
            h, e = H[key], E.get(key if key != "chat_resend_history" else "chat_first", {})  # resend = a whole-history prefill
            print(
                f"| {key[5:]} | {ms(h['ttft_p50'])} / {ms(h['ttft_p99'])} | {ms(e.get('ttft_p50'))} | {ratio(h['ttft_p50'], e.get('ttft_p50'))} | "
                f"{ms(h['e2e_p50'])} / {ms(h['e2e_p99'])} |"
            )
        print(
            f"\nserver snapshot write per turn: {ms(H['snapshot_write_s_per_turn'])} ms (first and later turns; sync durability: "
            f"inside the turn's E2E); bytes a resumed turn writes: {(H['snapshot_bytes_per_resumed_turn'] or 0) / 1e6:.1f} MB; "
            f"{H['restart_ready_s']:.1f} s to ready after the restart"
        )
    print(f"ready after {H['ready_s']:.1f} s; compilations after ready: {H['compilations_after_ready']:g}; preemptions: {H['preemptions']:g}")
    if "first_after_ready" in H and "fixed_c1" in H:
        f, steady = H["first_after_ready"], H["fixed_c1"]
        print(
            f"first request after ready: E2E {ms(f['e2e_p50'])} ms, TTFT {ms(f['ttft_p50'])} ms; the same request warm (c=1 p50): "
            f"E2E {ms(steady['e2e_p50'])} ms ({ratio(f['e2e_p50'], steady['e2e_p50'])}), TTFT {ms(steady['ttft_p50'])} ms"
        )


def machine() -> dict:
    info = {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return info


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def ints(text: str) -> list[int]:
    """A comma-separated list of integers (a flag's value)."""
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="granite-4.0-h-tiny")
    ap.add_argument("--tiny", action="store_true", help="shrink the model to a few narrow layers (a CPU run)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--concurrency", type=ints, default=[1, 16, 64, 256])
    ap.add_argument("--rounds", type=int, default=4, help="requests per client in the fixed workloads")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[4.0, 16.0, 64.0], help="requests/s of the sweep")
    ap.add_argument("--rate-requests", type=int, default=256)
    ap.add_argument("--users", type=int, default=8, help="chat users (0: no chat workloads and no restart)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--history", type=int, default=32768, help="tokens of each chat's first message")
    ap.add_argument("--turn-len", type=int, default=64)
    ap.add_argument("--reply-len", type=int, default=64)
    ap.add_argument("--max-running-requests", type=int, default=None, help="default: the largest concurrency")
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="the server's and the in-process engine's step budget (default: the engine's)"
    )
    ap.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch threads on the CPU, server and in-process alike (OpenMP threads that outnumber free cores spin)",
    )
    ap.add_argument(
        "--client-procs",
        type=int,
        default=0,
        help="client processes of the fixed workloads (0: a quarter of the cores, at least 1); one event loop caps at a few thousand tok/s",
    )
    ap.add_argument("--server-args", default="", help="more `engram serve` flags, one string")
    ap.add_argument("--workdir", default=None, help="checkpoints and snapshots (default: $ENGRAM_CACHE_DIR/serve_bench)")
    ap.add_argument("--out", default=None, help="JSON file name under benchmarks/results/ (or a path)")
    a = ap.parse_args()
    device = "cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device)
    if device == "cpu":
        torch.set_num_threads(a.cpu_threads)
    config_path = find_config(a.config)
    config = json.loads(config_path.read_text()) | (TINY if a.tiny else {})
    work = Path(a.workdir or Path(os.environ.get("ENGRAM_CACHE_DIR", Path.home() / ".cache" / "engram")) / "serve_bench")
    work.mkdir(parents=True, exist_ok=True)
    model = build_checkpoint(config, device, work)
    log(f"checkpoint {model}")
    running = a.max_running_requests or max(a.concurrency + [a.users])
    context = max(a.history + a.turns * (a.turn_len + a.reply_len + 16) * 2, 2 * a.prompt_len + 2 * a.output_len) + 256
    budget = {"max_num_batched_tokens": a.max_num_batched_tokens} if a.max_num_batched_tokens else {}
    engine_args = EngineArgs(model_path=str(model), device=device, max_running_requests=running, context_length=context, **budget)
    snapshots = Path(tempfile.mkdtemp(dir=work, prefix="snapshots-"))
    server_args = [
        "--model-path",
        str(model),
        "--device",
        device,
        "--max-running-requests",
        str(running),
        "--context-length",
        str(context),
        "--snapshot-dir",
        str(snapshots),
        *(["--max-num-batched-tokens", str(a.max_num_batched_tokens)] if a.max_num_batched_tokens else []),
        *a.server_args.split(),
    ]
    res = {
        "machine": machine(),
        "commit": commit(),
        "command": " ".join(sys.argv),
        "config": config_path.name,
        "tiny": a.tiny,
        "args": vars(a),
        "server_args": server_args,
    }
    server = ServerProcess(
        ["--served-model-name", MODEL, *server_args], work / "server.log", env={"OMP_NUM_THREADS": str(torch.get_num_threads())}
    )  # as many torch threads as the in-process engine
    try:
        res["http"] = asyncio.run(run_http(a, server, config["vocab_size"]))
    finally:
        if server.proc is not None:
            server.kill()
    res["engine"] = run_engine(a, engine_args, config["vocab_size"])
    if a.out:
        out = Path(a.out) if os.sep in a.out else ROOT / "benchmarks" / "results" / a.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2))
        log(f"results in {out}")
    print_tables(res)
    if res["http"]["compilations_after_ready"] > 0:
        print(f"FAIL: the server compiled or captured {res['http']['compilations_after_ready']:g} times after it said ready")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
