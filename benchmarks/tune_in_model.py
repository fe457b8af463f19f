"""Block sizes of the decode kernels, timed inside the whole model (`triton_ops.blocks.GEMV_CONFIG`).

    python benchmarks/tune_in_model.py [--config granite-4.0-h-tiny] [--batch 64] [--keys moe_grouped_up,moe_grouped_down]
    python benchmarks/tune_in_model.py --batch 64 [--prompt-len 1024] --variants variants.py

With --variants, the file defines VARIANTS = {name: {setting: value}}, a setting being "module.NAME"
or "module.DICT[key]" of a module of engram.ops.triton_ops (a threshold, a GEMV_CONFIG entry): each
variant is applied on top of the starting values and timed the same way, two rounds in turn.

tune_gemv.py times one kernel alone, on uniform routing; inside a decode step a kernel can rank the
configurations differently (the model's own routing, the kernels around it). This builds the engine
once with random weights, prints how the model's tokens spread over the experts, and for each
configuration of each GEMV_CONFIG entry recaptures the decode graph and times its replay (the GPU
time of one step). Each entry keeps its best configuration for the entries after it.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import runpy
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_speed import build_models, engine_decode, find_config  # noqa: E402

from engram.ops import dispatch, triton_ops  # noqa: E402
from engram.ops import moe as moe_ref  # noqa: E402

GEMV_GRID = list(itertools.product((1, 2, 4), (1024, 2048, 4096), (1, 2)))
GRIDS = {
    "linear": GEMV_GRID,
    "linear_row": GEMV_GRID,
    "linear_row_long_k": list(itertools.product((1, 2, 4), (512, 1024, 2048, 4096), (1, 2))),
    "moe_up": list(itertools.product((1, 2), (1024, 2048), (1, 2))),
    "moe_down": list(itertools.product((1, 2, 4), (512, 1024), (1, 2))),
    "moe_grouped_up": list(itertools.product((16, 32), (32, 64), (64, 128), (4,), (3, 4))),
    "moe_grouped_down": list(itertools.product((64, 128), (64, 128), (4,), (3, 4))),
    "linear_dot": list(itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4))),
    "linear_dot_narrow": list(itertools.product((16, 32), (128, 256), (4,), (3, 4))),
    "linear_dot_narrow_64": list(itertools.product((16, 32), (128, 256), (4,), (3, 4, 5, 8))),
}


def step_ms(eng, batch: int, vocab: int, prompt_len: int = 128) -> float:
    """GPU time of one decode step at this batch, from a freshly captured graph."""
    eng.runner._graphs.clear()
    return engine_decode(eng, batch, prompt_len, 16, vocab)["gpu_step_ms"]


def routing_report(eng, batch: int) -> None:
    """Routed pairs per expert in each MoE layer of one eager decode step (the graph's last inputs)."""
    kernels = dispatch.kernels()
    counts = []

    def spy(x, w_in, w_out, weights, ids, *args, **kw):
        counts.append(torch.bincount(ids.flatten(), minlength=w_in.shape[0]).cpu())
        return kernels.moe_experts(x, w_in, w_out, weights, ids, *args, **kw)

    def spy_softmax_topk(x, logits, top_k, w_in, *args, **kw):  # Granite routes inside the op
        ids = moe_ref.route_softmax_topk(logits, top_k)[1]
        counts.append(torch.bincount(ids.flatten(), minlength=w_in.shape[0]).cpu())
        return kernels.softmax_topk_experts(x, logits, top_k, w_in, *args, **kw)

    dispatch.use_kernels(replace(kernels, moe_experts=spy, softmax_topk_experts=spy_softmax_topk))
    try:
        with torch.inference_mode():
            eng.runner.model(eng.runner._graph_batch(eng.runner.decode_bucket(batch)))
    finally:
        dispatch.use_kernels(kernels)
    if not counts:
        return
    c = torch.stack(counts)
    bm = triton_ops.blocks.GEMV_CONFIG["moe_grouped_up"][0]
    blocks = ((c + bm - 1) // bm).sum(1)
    print(
        f"routing at batch {batch}: experts used per layer {c.gt(0).sum(1).float().mean():.1f} of {c.shape[1]}; "
        f"most pairs on one expert per layer: mean {c.max(1).values.float().mean():.1f}, max {int(c.max())}; "
        f"blocks of {bm} pairs per layer: mean {blocks.float().mean():.1f}",
        flush=True,
    )


def _setting(key: str) -> tuple[dict, str]:
    """The dict holding a --variants setting ("module.NAME" or "module.DICT[key]"), and its key there."""
    path, _, entry = key.rstrip("]").partition("[")
    module, name = path.rsplit(".", 1)
    holder = vars(importlib.import_module(f"engram.ops.triton_ops.{module}"))
    return (holder[name], entry) if entry else (holder, name)


def _apply(settings: dict) -> None:
    for key, value in settings.items():
        holder, k = _setting(key)
        holder[k] = value


def compare_variants(time_step: Callable[[], float], batch: int, path: str) -> dict:
    variants = runpy.run_path(path)["VARIANTS"]
    start = {}
    for settings in variants.values():
        for key in settings:
            holder, k = _setting(key)
            start.setdefault(key, holder[k])
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2):
        for name, settings in variants.items():
            _apply({**start, **settings})
            times[name].append(time_step())
    _apply(start)
    for name, ts in sorted(times.items(), key=lambda kv: sum(kv[1])):
        mean = sum(ts) / len(ts)
        print(f"batch {batch} {name:24s} {' '.join(f'{t:.4f}' for t in ts)} ms, mean {mean:.4f} ({batch / mean * 1e3:,.0f} tok/s)", flush=True)
    return times


def sweep_keys(time_step: Callable[[], float], keys: list[str]) -> dict:
    """Each GEMV_CONFIG entry in turn over its grid; each keeps its best for the entries after it."""
    results = {}
    for key in keys:
        saved, rows = triton_ops.blocks.GEMV_CONFIG[key], []
        for cfg in GRIDS[key]:
            triton_ops.blocks.GEMV_CONFIG[key] = cfg
            try:
                rows.append((time_step(), cfg))
            except Exception as e:  # noqa: BLE001 - a config may not compile (registers, shared memory)
                print(f"  {key} {cfg}: {type(e).__name__}", flush=True)
        if not rows:
            triton_ops.blocks.GEMV_CONFIG[key] = saved
            print(f"{key}: no configuration ran", flush=True)
            continue
        rows.sort()
        triton_ops.blocks.GEMV_CONFIG[key] = rows[0][1]
        print(
            f"{key}: best {rows[0][1]} {rows[0][0]:.3f} ms; current {saved} "
            f"{dict((c, t) for t, c in rows).get(saved, float('nan')):.3f} ms; "
            f"next {[(c, round(t, 3)) for t, c in rows[1:5]]}",
            flush=True,
        )
        results[key] = {"best": rows[0][1], "table": [(c, t) for t, c in rows]}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="granite-4.0-h-tiny")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--keys", default="moe_grouped_up,moe_grouped_down", help=f"GEMV_CONFIG entries, of {sorted(GRIDS)}")
    ap.add_argument("--variants", default=None, help="a file of named settings to time against each other (above)")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens of each sequence before the timed steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup = argparse.Namespace(
        decode_batches=[args.batch],
        max_batched_tokens=16384,
        max_total_tokens=args.batch * (args.prompt_len + 128) + 4096,
        resume_histories=[],
        prefill_lens=[256],
        prompt_len=args.prompt_len,
        decode_steps=16,
        new_tokens=0,
        reference_ops=False,
        no_cuda_graph=False,
        no_overlap_schedule=False,
        mamba_ssm_dtype="float32",
        no_hf=True,
    )
    results = {"gpu": torch.cuda.get_device_name(), "batch": args.batch, "config": args.config}
    with tempfile.TemporaryDirectory() as tmp:
        _, eng = build_models(find_config(args.config), Path(tmp), setup)
        vocab = eng.spec.vocab_size

        def time_step() -> float:
            return step_ms(eng, args.batch, vocab, args.prompt_len)

        print(f"current {dict(triton_ops.blocks.GEMV_CONFIG)}: {time_step():.3f} ms per step", flush=True)
        routing_report(eng, args.batch)
        if args.variants:
            results["variants"] = compare_variants(time_step, args.batch, args.variants)
        else:
            results.update(sweep_keys(time_step, args.keys.split(",")))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
