"""Choose the block sizes of the small-batch kernels (`triton_ops.GEMV_CONFIG`) on this GPU.

    python benchmarks/tune_gemv.py [--config granite-4.0-h-tiny] [--rows 1]

For the config's decode shapes it times every configuration in a small grid, each call replayed
from a CUDA graph that cycles through enough weight copies to defeat the L2 cache, and prints the
best per kernel with the bandwidth reached: up to LINEAR_GEMV_MAX_ROWS rows, the GEMVs (Mamba2
in_proj / out_proj next to cuBLAS, the MoE with its shared expert); above, the grouped MoE GEMM
(`--rows 64`: a decode batch of 64).
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
from engram.ops import triton_ops  # noqa: E402

GRID = list(itertools.product((1, 2, 4, 8), (512, 1024, 2048), (1, 2, 4, 8)))
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
    saved = triton_ops.GEMV_CONFIG[key]
    for cfg in grid:
        triton_ops.GEMV_CONFIG[key] = cfg
        try:
            rows.append((time_graph(fn, copies), cfg))
        except Exception as e:  # noqa: BLE001 - a config may not compile (registers, shared memory)
            print(f"  {key} {cfg}: {type(e).__name__}")
    triton_ops.GEMV_CONFIG[key] = saved
    rows.sort()
    best_t, best = rows[0]
    print(f"{key}: best {best} {best_t * 1e6:.2f} us ({nbytes / best_t / 1e12:.2f} TB/s); "
          f"current {saved} {dict((c, t) for t, c in rows)[saved] * 1e6:.2f} us; "
          f"next: {[(c, round(t * 1e6, 2)) for t, c in rows[1:4]]}", flush=True)
    return {"best": best, "best_us": best_t * 1e6, "table": [(c, t * 1e6) for t, c in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="granite-4.0-h-tiny")
    ap.add_argument("--rows", type=int, default=1, help="tokens per step (decode batch)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = json.loads(find_config(args.config).read_text())
    dt, dev, m = torch.bfloat16, "cuda", args.rows
    H = cfg["hidden_size"]
    d_in = cfg["mamba_expand"] * H
    conv_dim = d_in + 2 * cfg["mamba_n_groups"] * cfg["mamba_d_state"]
    results = {"gpu": torch.cuda.get_device_name(), "rows": m, "config": args.config}
    gemv = m <= triton_ops.LINEAR_GEMV_MAX_ROWS

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=dt) * 0.02

    # The linear layers take the GEMV only up to LINEAR_GEMV_MAX_ROWS rows (cuBLAS above).
    linear_shapes = {"in_proj": (d_in + conv_dim + cfg["mamba_n_heads"], H), "out_proj": (H, d_in)} if gemv else {}
    for name, (n, k) in linear_shapes.items():
        ws = [rnd(n, k) for _ in range(COPIES)]
        x = rnd(m, k)
        nbytes = n * k * 2
        t_cublas = time_graph(lambda i: F.linear(x, ws[i]), COPIES)
        print(f"{name} [{n} x {k}], {m} row(s): cuBLAS {t_cublas * 1e6:.2f} us ({nbytes / t_cublas / 1e12:.2f} TB/s)", flush=True)
        r = sweep("linear", lambda i: triton_ops.linear(x, ws[i]), COPIES, nbytes)
        r["cublas_us"] = t_cublas * 1e6
        results[name] = r

    E, I, top_k, Is = cfg["num_local_experts"], cfg["intermediate_size"], cfg["num_experts_per_tok"], cfg["shared_intermediate_size"]
    copies = 4
    w_in = [rnd(E, 2 * I, H) for _ in range(copies)]
    w_out = [rnd(E, H, I) for _ in range(copies)]
    s_in = [rnd(2 * Is, H) for _ in range(copies)]
    s_out = [rnd(H, Is) for _ in range(copies)]
    x = rnd(m, H)
    weights = torch.full((m, top_k), 1.0 / top_k, device=dev)
    ids = torch.stack([torch.randperm(E, device=dev)[:top_k] for _ in range(m)])
    distinct = ids.unique().numel()
    nbytes = distinct * 3 * I * H * 2 + 3 * Is * H * 2

    def moe(i):
        return triton_ops.moe_experts(x, w_in[i], w_out[i], weights, ids, F.silu, True, (s_in[i], s_out[i]))

    tk = m * top_k
    if not gemv and not triton_ops.MOE_GEMV_MAX_PAIRS < tk <= triton_ops.MOE_GROUPED_SMALL_PAIRS:
        raise SystemExit(f"{tk} routed pairs do not take the tuned grouped MoE GEMM "
                         f"(it runs for {triton_ops.MOE_GEMV_MAX_PAIRS + 1}..{triton_ops.MOE_GROUPED_SMALL_PAIRS} pairs)")
    print(f"moe: {distinct} experts + shared, {nbytes / 1e6:.1f} MB per call", flush=True)
    if gemv:
        results["moe_up"] = sweep("moe_up", moe, copies, nbytes)
        triton_ops.GEMV_CONFIG["moe_up"] = tuple(results["moe_up"]["best"])
        results["moe_down"] = sweep("moe_down", moe, copies, nbytes)
    else:  # the grouped GEMM (and, inside the same timing, the alignment and the combine)
        results["moe_grouped_up"] = sweep("moe_grouped_up", moe, copies, nbytes, GROUPED_UP_GRID)
        triton_ops.GEMV_CONFIG["moe_grouped_up"] = tuple(results["moe_grouped_up"]["best"])
        results["moe_grouped_down"] = sweep("moe_grouped_down", moe, copies, nbytes, GROUPED_DOWN_GRID)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
