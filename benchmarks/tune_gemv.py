"""Choose the block sizes of the small-batch kernels (`triton_ops.blocks.GEMV_CONFIG`) on this GPU.

    python benchmarks/tune_gemv.py [--config granite-4.0-h-tiny] [--rows 1]

For the config's decode shapes it times every configuration in a small grid, each call replayed
from a CUDA graph that cycles through enough weight copies to defeat the L2 cache, and prints the
best per kernel with the bandwidth reached: Mamba2's in_proj / out_proj next to cuBLAS (the GEMV up
to LINEAR_GEMV_MAX_ROWS rows, the tensor-core kernel up to LINEAR_DOT_MAX_ROWS), and the MoE with
its shared expert (the GEMVs up to MOE_GEMV_MAX_PAIRS routed pairs, the grouped GEMM above:
`--rows 64` is a decode batch of 64).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_speed import find_config, replay_seconds  # noqa: E402

from engram.models.spec import parse_model_spec  # noqa: E402
from engram.ops import triton_ops  # noqa: E402

GRID = list(itertools.product((1, 2, 4, 8), (512, 1024, 2048), (1, 2, 4, 8)))
LINEAR_DOT_GRID = list(itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4, 5)))
GROUPED_UP_GRID = list(itertools.product((16,), (16, 32, 64), (32, 64, 128), (2, 4), (3, 4, 5)))
GROUPED_DOWN_GRID = list(itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4)))
COPIES = 12  # weight copies cycled through: more bytes than the L2 cache holds


def time_graph(fn, copies: int, reps: int = 8) -> float:
    """Seconds per call of fn(i) for i cycling over the copies, replayed from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for i in range(copies):
                fn(i)
    return replay_seconds(g, 5) / (reps * copies)


def sweep(key: str, fn, copies: int, nbytes: int, grid: list[tuple] = GRID) -> dict:
    rows = []
    saved = triton_ops.blocks.GEMV_CONFIG[key]
    for cfg in grid:
        triton_ops.blocks.GEMV_CONFIG[key] = cfg
        try:
            rows.append((time_graph(fn, copies), cfg))
        except Exception as e:  # noqa: BLE001 - a config may not compile (registers, shared memory)
            print(f"  {key} {cfg}: {type(e).__name__}")
    triton_ops.blocks.GEMV_CONFIG[key] = saved
    rows.sort()
    best_t, best = rows[0]
    print(
        f"{key}: best {best} {best_t * 1e6:.2f} us ({nbytes / best_t / 1e12:.2f} TB/s); "
        f"current {saved} {dict((c, t) for t, c in rows)[saved] * 1e6:.2f} us; "
        f"next: {[(c, round(t * 1e6, 2)) for t, c in rows[1:4]]}",
        flush=True,
    )
    return {"best": best, "best_us": best_t * 1e6, "table": [(c, t * 1e6) for t, c in rows]}


def tune_moe(cfg: dict, m: int, rnd, results: dict) -> None:
    H = cfg["hidden_size"]
    gemv = m <= triton_ops.linear.LINEAR_GEMV_MAX_ROWS
    E, I, top_k, Is = cfg["num_local_experts"], cfg["intermediate_size"], cfg["num_experts_per_tok"], cfg["shared_intermediate_size"]
    copies = 4
    w_in = [rnd(E, 2 * I, H) for _ in range(copies)]
    w_out = [rnd(E, H, I) for _ in range(copies)]
    s_in = [rnd(2 * Is, H) for _ in range(copies)]
    s_out = [rnd(H, Is) for _ in range(copies)]
    x = rnd(m, H)
    weights = torch.full((m, top_k), 1.0 / top_k, device=x.device)
    ids = torch.stack([torch.randperm(E, device=x.device)[:top_k] for _ in range(m)])
    distinct = ids.unique().numel()
    nbytes = distinct * 3 * I * H * 2 + 3 * Is * H * 2

    def moe(i):
        return triton_ops.moe.moe_experts(x, w_in[i], w_out[i], weights, ids, F.silu, True, (s_in[i], s_out[i]))

    tk = m * top_k
    if not gemv and not triton_ops.moe.MOE_GEMV_MAX_PAIRS < tk <= triton_ops.moe.MOE_GROUPED_SMALL_PAIRS:
        raise SystemExit(
            f"{tk} routed pairs do not take the tuned grouped MoE GEMM "
            f"(it runs for {triton_ops.moe.MOE_GEMV_MAX_PAIRS + 1}..{triton_ops.moe.MOE_GROUPED_SMALL_PAIRS} pairs)"
        )
    print(f"moe: {distinct} experts + shared, {nbytes / 1e6:.1f} MB per call", flush=True)
    if gemv:
        results["moe_up"] = sweep("moe_up", moe, copies, nbytes)
        triton_ops.blocks.GEMV_CONFIG["moe_up"] = tuple(results["moe_up"]["best"])
        results["moe_down"] = sweep("moe_down", moe, copies, nbytes)
    else:  # the grouped GEMM (and, inside the same timing, the alignment and the combine)
        results["moe_grouped_up"] = sweep("moe_grouped_up", moe, copies, nbytes, GROUPED_UP_GRID)
        triton_ops.blocks.GEMV_CONFIG["moe_grouped_up"] = tuple(results["moe_grouped_up"]["best"])
        results["moe_grouped_down"] = sweep("moe_grouped_down", moe, copies, nbytes, GROUPED_DOWN_GRID)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="granite-4.0-h-tiny")
    ap.add_argument("--rows", type=int, default=1, help="tokens per step (decode batch)")
    ap.add_argument("--kernels", default="linear,moe", help="which to tune: linear, moe or both")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = json.loads(find_config(args.config).read_text())
    spec = parse_model_spec(cfg)
    dt, dev, m = torch.bfloat16, "cuda", args.rows
    H, mamba = spec.hidden_size, spec.mamba
    results = {"gpu": torch.cuda.get_device_name(), "rows": m, "config": args.config}
    gemv = m <= triton_ops.linear.LINEAR_GEMV_MAX_ROWS

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=dt) * 0.02

    linear_shapes = {"in_proj": (mamba.intermediate_size + mamba.conv_dim + mamba.num_heads, H), "out_proj": (H, mamba.intermediate_size)}
    tune_linear = "linear" in args.kernels and m <= triton_ops.linear.LINEAR_DOT_MAX_ROWS
    for name, (n, k) in linear_shapes.items() if tune_linear else ():
        ws = [rnd(n, k) for _ in range(COPIES)]
        x = rnd(m, k)
        nbytes = n * k * 2
        key, grid = ("linear", GRID) if gemv else (triton_ops.linear.linear_dot_config_key(n, m, x.device), LINEAR_DOT_GRID)
        t_cublas = time_graph(lambda i: F.linear(x, ws[i]), COPIES)
        print(f"{name} [{n} x {k}], {m} row(s): cuBLAS {t_cublas * 1e6:.2f} us ({nbytes / t_cublas / 1e12:.2f} TB/s)", flush=True)
        r = sweep(key, lambda i: triton_ops.linear.linear(x, ws[i]), COPIES, nbytes, grid)
        r["cublas_us"] = t_cublas * 1e6
        results[name] = r

    if "moe" in args.kernels:
        if "num_local_experts" not in cfg:
            raise SystemExit("the MoE sweep builds Granite's gated experts: the config has no num_local_experts")
        tune_moe(cfg, m, rnd, results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
