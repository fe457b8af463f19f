"""What a step costs by the path it takes, and what mixing prefill chunks into decode steps costs
a closed loop whose requests arrive steps apart (as HTTP clients' do), in-process, one run.

    python benchmarks/step_paths.py --config granite-4.0-h-tiny [--out results.json]

1. Step times (the device synchronized around each step, median): a decode step of B sequences
   replaying its CUDA graph; the same step eager; B-1 decoding sequences plus one new P-token
   prompt (a mixed step, eager); prompts of --prefill-lens tokens alone.
2. Closed loops of C clients, P tokens in and O out, R requests each: started together ("in step")
   and started O/C steps apart ("staggered", the arrival pattern of HTTP clients), each with
   --enable-mixed-chunk on and off: output tok/s and how many steps took each path.
Both for each --scan-max-lens: the longest prefill that takes the token-by-token SSD scan instead
of fla-core's chunked kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_speed as bs  # noqa: E402  (the same model builder and helpers as the speed benchmark)


def step_path(runner, chunks) -> str:
    if runner._graphs_usable(chunks):
        return "decode graph"
    if runner._prefill_graph_usable(chunks):
        return "prefill graph"
    decode = sum(1 for c in chunks if c.length == 1 and c.start > 0)
    return "eager, mixed" if 0 < decode < len(chunks) else ("eager, decode" if decode else "eager, prefill")


def count_paths(eng) -> Counter:
    """Count the path of every step the runner runs from now on."""
    counts: Counter = Counter()
    run = eng.runner.run

    def counted(chunks):
        counts[step_path(eng.runner, chunks)] += 1
        return run(chunks)

    eng.runner.run = counted
    return counts


def timed_steps(eng, n: int) -> list[float]:
    times = []
    for _ in range(n):
        bs.sync()
        t = time.perf_counter()
        eng.step()
        bs.sync()
        times.append(time.perf_counter() - t)
    return times


def step_times(eng, batch: int, prompt_len: int, vocab: int, reps: int) -> dict:
    ids = [bs.uid("d") for _ in range(batch - 1)]
    for i, r in enumerate(ids):
        eng.add_request(r, bs.rand_tokens(prompt_len, vocab, 100 + i), bs.greedy(None))
    while any(s.num_uncomputed > 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    timed_steps(eng, 4)
    res = {"batch": batch, "prompt_len": prompt_len}
    res["decode_graph_ms"] = 1e3 * statistics.median(timed_steps(eng, reps))
    eng.runner.enable_cuda_graph = False
    res["decode_eager_ms"] = 1e3 * statistics.median(timed_steps(eng, reps))
    eng.runner.enable_cuda_graph = True
    mixed = []
    for i in range(reps):
        r = bs.uid("m")
        eng.add_request(r, bs.rand_tokens(prompt_len, vocab, 500 + i), bs.greedy(None))
        mixed += timed_steps(eng, 1)
        eng.abort_request(r)
        timed_steps(eng, 1)
    res["mixed_eager_ms"] = 1e3 * statistics.median(mixed)
    for r in ids:
        eng.abort_request(r)
    bs.run_all(eng)
    return res


def prefill_ms(eng, length: int, vocab: int, reps: int) -> float:
    """Median time of the step that computes one `length`-token prompt alone (after one warm-up)."""
    alone = []
    for i in range(reps + 1):
        eng.add_request(bs.uid("p"), bs.rand_tokens(length, vocab, 900 + i), bs.greedy(1))
        alone += timed_steps(eng, 1)
        bs.run_all(eng)
    return 1e3 * statistics.median(alone[1:])


def profile_prefill(eng, length: int, vocab: int) -> None:
    """Host and device time of one eager prefill of `length` tokens: cProfile's top functions and
    the profiler's CUDA runtime calls (synchronizations show as long cudaStreamSynchronize /
    cudaMemcpyAsync rows)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    r = bs.uid("w")
    eng.add_request(r, bs.rand_tokens(length, vocab, 11), bs.greedy(1))
    bs.run_all(eng)
    eng.add_request(bs.uid("prof"), bs.rand_tokens(length, vocab, 12), bs.greedy(1))
    pr = cProfile.Profile()
    bs.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pr.enable()
        timed_steps(eng, 1)
        pr.disable()
    bs.run_all(eng)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60), flush=True)
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


def closed_loop(eng, clients: int, prompt_len: int, output_len: int, rounds: int, stagger: int, vocab: int) -> dict:
    """Each client sends its next request when its last one finishes; client i starts after
    i * stagger steps."""
    counts = count_paths(eng)
    left = {c: rounds for c in range(clients)}
    owner: dict[str, int] = {}
    seed = [0]

    def send(c: int) -> None:
        r = bs.uid("c")
        owner[r] = c
        seed[0] += 1
        eng.add_request(r, bs.rand_tokens(prompt_len, vocab, 7000 + seed[0]), bs.greedy(output_len))
        left[c] -= 1

    generated, step, started = 0, 0, time.perf_counter()
    pending_start = list(range(clients))
    while pending_start or eng.has_unfinished_requests():
        while pending_start and pending_start[0] * stagger <= step:
            send(pending_start.pop(0))
        for out in eng.step():
            if out.finished:
                generated += len(out.token_ids)
                c = owner.pop(out.request_id)
                if left[c]:
                    send(c)
        step += 1
    bs.sync()
    seconds = time.perf_counter() - started
    eng.runner.run = type(eng.runner).run.__get__(eng.runner)
    return {"clients": clients, "stagger_steps": stagger, "tok_s": generated / seconds, "seconds": seconds, "steps": step, "paths": dict(counts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="granite-4.0-h-tiny")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--scan-max-lens", default="128", help="values of SSD_SCAN_MAX_LEN to compare")
    ap.add_argument("--mixed", default="on,off", help="--enable-mixed-chunk values of the closed loops")
    ap.add_argument("--staggers", default="0,auto", help="steps between the clients' starts (auto: output-len / batch)")
    ap.add_argument("--prefill-lens", default="256,512,1024,2048")
    ap.add_argument("--profile", action="store_true", help="only profile one eager prefill of --prompt-len tokens")
    args = ap.parse_args()
    ns = argparse.Namespace(
        decode_batches=[args.batch],
        max_batched_tokens=2048,
        max_total_tokens=None,
        resume_histories=[0],
        prefill_lens=[int(n) for n in args.prefill_lens.split(",")] + [args.prompt_len],
        prompt_len=args.prompt_len,
        decode_steps=args.output_len,
        new_tokens=0,
        no_hf=True,
        reference_ops=False,
        no_cuda_graph=False,
        no_overlap_schedule=False,
        mamba_ssm_dtype="float32",
    )
    results: dict = {"config": args.config}
    with tempfile.TemporaryDirectory() as tmp:
        _, eng = bs.build_models(bs.find_config(args.config), Path(tmp), ns)
        eng.warm_up()
        eng.mark_ready()
        vocab = eng.spec.vocab_size
        if args.profile:
            profile_prefill(eng, args.prompt_len, vocab)
            return
        from engram.ops.triton_ops import ssd

        for scan_max in [int(n) for n in args.scan_max_lens.split(",")]:
            ssd.SSD_SCAN_MAX_LEN = scan_max  # prefills up to this long take the token-by-token scan, not fla
            run: dict = {"ssd_scan_max_len": scan_max}
            run["prefill_alone_ms"] = {n: prefill_ms(eng, n, vocab, args.reps) for n in [int(n) for n in args.prefill_lens.split(",")]}
            run["step_times"] = step_times(eng, args.batch, args.prompt_len, vocab, args.reps)
            loops = []
            for mixed in [m == "on" for m in args.mixed.split(",")]:
                eng.scheduler.mixed_chunks = mixed
                for stagger in [int(n) if n != "auto" else max(1, args.output_len // args.batch) for n in args.staggers.split(",")]:
                    r = closed_loop(eng, args.batch, args.prompt_len, args.output_len, args.rounds, stagger, vocab)
                    r["mixed_chunks"] = mixed
                    loops.append(r)
            run["closed_loops"] = loops
            bs.log(f"scan up to {scan_max}: {json.dumps(run)}")
            results.setdefault("runs", []).append(run)
        results["compilations_after_warmup"] = eng.stats().compilations_after_ready
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
