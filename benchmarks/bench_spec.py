"""Speculative decoding (engine/speculative.py) against plain decoding, in-process, one run.

    python benchmarks/bench_spec.py --config granite-4.0-h-tiny [--out results.json]
    python benchmarks/bench_spec.py --model-path CHECKPOINT --device cpu   (a dry run of the script)
    python benchmarks/bench_spec.py ... --count-ops   (only: ops and launches per decode / verify step)

Two engines on the same random weights (from a config, as bench_speed.py builds them) or a
checkpoint: plain (CUDA graphs, overlap schedule) and with `--speculative-config` n-gram.
1. Step cost: with B sequences decoding, the mean time of a plain decode step vs a verify step
   of k drafted tokens per sequence (drafts forced to length k; with CUDA graphs the verify step
   replays a verify graph of its batch bucket, engine/verify_graphs.py), for each B in --batches
   and k in --ks.
2. Decode tok/s at batch 1 on a prompt that repeats one random block: plain; n-gram prompt lookup
   (its acceptance is what random weights give); and "forced acceptance": drafts that are the
   speculative engine's own greedy output, iterated until it keeps them all (bfloat16 verify
   steps round otherwise than decode steps, so plain decoding's output would be rejected where
   the two diverge), standing in for a model whose output repeats its prompt (clearly not a
   measurement of n-gram acceptance).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_speed as bs  # noqa: E402  (config lookup, logging)
from engine_utils import launch_counts  # noqa: E402  (tests/)

from engram.args import EngineArgs  # noqa: E402
from engram.engine import engine as engine_mod  # noqa: E402
from engram.engine.drafter import NgramDrafter  # noqa: E402
from engram.engine.request import SamplingParams  # noqa: E402


class FixedDrafter:
    """Always k tokens (the last one repeated): a verify step of a known width."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return [token_ids[-1]] * min(self.k, k)


class ForcedDrafter:
    """The continuation a plain greedy run produced: every draft is kept (forced acceptance)."""

    def __init__(self, full: list[int]):
        self.full = full

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return self.full[len(token_ids) : len(token_ids) + k]


def kept_drafts(spec: engine_mod.LLMEngine, prompt: list[int], plain_out: list[int], max_tokens: int, rounds: int = 4) -> ForcedDrafter:
    """Drafts the speculative engine keeps: its own greedy output when drafting it, iterated to a
    fixed point. In bfloat16 a verify step rounds differently from a decode step, so plain
    decoding's output diverges from it and is rejected from there on."""
    full = plain_out
    for _ in range(rounds):
        spec.speculator.drafter = ForcedDrafter(prompt + full)
        _, got = decode_rate(spec, prompt, max_tokens)
        if got == full:
            break
        full = got
    return ForcedDrafter(prompt + full)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_engines(args) -> tuple[engine_mod.LLMEngine, engine_mod.LLMEngine]:
    common = dict(
        device=args.device,
        max_running_requests=max(args.batches),
        max_total_tokens=args.max_total_tokens,
        context_length=args.prompt_block * args.prompt_repeats + args.max_tokens + 64,
        max_num_batched_tokens=8192,
    )
    if args.model_path:
        base = EngineArgs(model_path=args.model_path, **common)
    else:
        workdir = Path(tempfile.mkdtemp())
        bs.random_weights_model(json.loads(bs.find_config(args.config).read_text()), workdir)
        base = EngineArgs(model_path=str(workdir), dtype="bfloat16", **common)
    spec_cfg = json.dumps({"method": "ngram", "num_speculative_tokens": max(args.ks), "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    return engine_mod.LLMEngine(base), engine_mod.LLMEngine(dataclasses.replace(base, speculative_config=spec_cfg))


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def mean_step_seconds(eng, batch: int, steps: int, prompt_len: int, params: SamplingParams | None = None, probe=None) -> float:
    """B sequences past their prefill, then `steps` steps timed together (none finishes meanwhile,
    whatever it accepts: they are aborted afterwards; the run fails if one did). `probe()` runs
    before they are aborted (a graph replayed alone on the last step's inputs)."""
    params = params or SamplingParams(max_tokens=8 * steps + 16, temperature=0.0, ignore_eos=True)
    ids = [f"s{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, tokens(prompt_len, eng.spec.vocab_size, i), params)
    while any(s.num_computed < s.num_prompt_tokens for s in eng.scheduler.running + list(eng.scheduler.waiting)):
        eng.step()
    for _ in range(2):  # a graph capture or a first verify step is not timed
        eng.step()
    sync(eng.device)
    started = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(eng.device)
    elapsed = (time.perf_counter() - started) / steps
    if len(eng.scheduler.running) != batch:
        raise RuntimeError(f"{batch - len(eng.scheduler.running)} of {batch} sequences ended inside the timed steps")
    if probe is not None:
        probe()
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return elapsed


def step_graph(eng, batch: int):
    """The CUDA graph a step of `batch` sequences replays: a verify graph with speculation, else a decode graph."""
    runner = eng.runner
    if runner.verify_graphs is not None:
        return runner.verify_graphs._graphs.get(runner.verify_graphs.bucket(batch), (None,))[0]
    return runner._graphs.get(runner.decode_bucket(batch), (None,))[0] if hasattr(runner, "decode_bucket") else None


def gpu_only_ms(eng, name: str, batch: int) -> dict:
    """The GPU time of a step alone: its graph replayed on the last step's inputs (none on a CPU)."""
    graph = step_graph(eng, batch) if eng.device.type == "cuda" else None
    return {f"{name}_gpu_only_ms": bs.replay_seconds(graph, 20) * 1e3} if graph is not None else {}


FORWARD = "bench_spec.forward"  # the profiler's mark of `runner.run`


def step_counts(eng, batch: int, prompt_len: int) -> dict:
    """B sequences past their prefill and two steps; then one step's `launch_counts`, whole and of
    its forward (`runner.run`)."""
    ids = [f"c{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, tokens(prompt_len, eng.spec.vocab_size, i), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    while any(s.num_computed < s.num_prompt_tokens for s in eng.scheduler.running + list(eng.scheduler.waiting)):
        eng.step()
    for _ in range(2):
        eng.step()
    sync(eng.device)
    run = eng.runner.run

    def marked(*args, **kwargs):
        with torch.profiler.record_function(FORWARD):
            return run(*args, **kwargs)

    eng.runner.run = marked
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if eng.device.type == "cuda" else [])
    try:
        with torch.profiler.profile(activities=activities) as prof:
            eng.step()
            sync(eng.device)
    finally:
        eng.runner.run = run
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    events = prof.events()
    return {"step": launch_counts(events), "forward": launch_counts(events, FORWARD)}


def count_ops(args, plain, spec) -> dict:
    """Op and launch counts of a decode step (eager, and as served) and of a verify step of k drafted
    tokens, per batch in --batches and k in --ks."""
    eager = engine_mod.LLMEngine(dataclasses.replace(plain.args, enable_cuda_graph=False))
    counts: dict = {}
    for b in args.batches:
        row = {"decode_eager": step_counts(eager, b, args.prompt_len), "decode": step_counts(plain, b, args.prompt_len)}
        for k in args.ks:
            spec.speculator.drafter = FixedDrafter(k)
            row[f"verify_k{k}"] = step_counts(spec, b, args.prompt_len)
        counts[f"batch_{b}"] = row
        bs.log(f"op counts, batch {b}: {json.dumps(row)}")
    return counts


def decode_rate(eng, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Output tokens/s after the first one (the prefill excluded), and the output."""
    eng.add_request(f"d{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    first, out = None, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if first is None and o.token_ids:
                sync(eng.device)
                first, n_first = time.perf_counter(), len(o.token_ids)
            out = o
    sync(eng.device)
    return (len(out.token_ids) - n_first) / (time.perf_counter() - first), out.token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="granite-4.0-h-tiny")
    ap.add_argument("--model-path", default=None, help="a checkpoint folder instead of --config's random weights")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prompt-block", type=int, default=48, help="the repeating workload: a random block of this many tokens ...")
    ap.add_argument("--prompt-repeats", type=int, default=6, help="... repeated this many times")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--profile-verify",
        type=int,
        default=0,
        metavar="K",
        help="only profile verify steps of K drafted tokens at batch 1 (torch profiler: the top ops) and stop",
    )
    ap.add_argument("--count-ops", action="store_true", help="only count the ops and launches of decode and verify steps (torch profiler)")
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    args.ks = [int(x) for x in args.ks.split(",")]
    results: dict = {"command": " ".join(sys.argv)}
    plain, spec = build_engines(args)
    if args.profile_verify:
        spec.speculator.drafter = FixedDrafter(args.profile_verify)
        mean_step_seconds(spec, 1, 4, args.prompt_len)  # compiled and warm
        with torch.profiler.profile() as prof:
            mean_step_seconds(spec, 1, 8, args.prompt_len)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))
        return
    results["device"] = torch.cuda.get_device_name(0) if plain.device.type == "cuda" else "cpu"
    if args.count_ops:
        results["op_counts"] = count_ops(args, plain, spec)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        return

    steps: dict = {}
    for b in args.batches:
        row: dict = {}
        base = mean_step_seconds(plain, b, args.steps, args.prompt_len, probe=lambda: row.update(gpu_only_ms(plain, "decode", b)))
        row["decode_ms"] = base * 1e3
        for k in args.ks:
            spec.speculator.drafter = FixedDrafter(k)
            t = mean_step_seconds(spec, b, args.steps, args.prompt_len, probe=lambda: row.update(gpu_only_ms(spec, f"verify_k{k}", b)))
            row[f"verify_k{k}_ms"], row[f"verify_k{k}_vs_decode"] = t * 1e3, t / base
        steps[f"batch_{b}"] = row
    if plain.device.type == "cuda":  # each kernel's share of the GPU time, batch 1
        for eng, name in ((plain, "decode"), (spec, f"verify k={args.ks[-1]}")):
            graph = step_graph(eng, 1)
            if graph is not None:
                mean_step_seconds(eng, 1, 2, args.prompt_len, probe=lambda: bs.log(f"{name} graph, batch 1:\n{bs.replay_critical_path(graph)}"))
        bs.log(f"step cost, batch {b}: {json.dumps({key: round(v, 3) for key, v in row.items()})}")
    results["step_cost"] = steps

    prompt = tokens(args.prompt_block, plain.spec.vocab_size, 99) * args.prompt_repeats
    rate, out = decode_rate(plain, prompt, args.max_tokens)
    rates = {"plain_tok_s": rate}
    cfg = spec.speculator.config
    forced = kept_drafts(spec, prompt, out, args.max_tokens)
    for mode, drafter in (("ngram", NgramDrafter(cfg.prompt_lookup_min, cfg.prompt_lookup_max)), ("forced_acceptance", forced)):
        spec.speculator.drafter = drafter
        before = spec.stats()
        r, got = decode_rate(spec, prompt, args.max_tokens)
        after = spec.stats()
        drafted = after.spec_draft_tokens_total - before.spec_draft_tokens_total
        accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
        rates[f"{mode}_tok_s"], rates[f"{mode}_vs_plain"] = r, r / rate
        rates[f"{mode}_acceptance"] = accepted / drafted if drafted else None
        rates[f"{mode}_same_output"] = got == out
    results["decode_batch_1_repeating"] = rates
    bs.log(f"decode at batch 1, repeating prompt: {json.dumps(rates, default=str)}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
