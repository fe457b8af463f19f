"""A decode step's big kernels alone, at a config's shapes, for Nsight Compute: Mamba2's in_proj and
out_proj through the tensor-core linear kernel, the MoE with its routing (Granite's softmax top-k and
shared expert), and the SSD state update with a float32 state. Each runs twice; profile the second.

    ncu --kernel-name regex:"_linear_dot|_moe_up_grouped|_moe_down_grouped|_ssd_update" --launch-skip 5 \\
        --launch-count 5 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        python3 benchmarks/ncu_kernels.py [--config granite-4.0-h-tiny] [--rows 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_speed import find_config  # noqa: E402

from engram.models.spec import parse_model_spec  # noqa: E402
from engram.ops.triton_ops import linear, moe, ssd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="granite-4.0-h-tiny")
    ap.add_argument("--rows", type=int, default=64, help="tokens per step (decode batch)")
    args = ap.parse_args()
    cfg = json.loads(find_config(args.config).read_text())
    spec, m = parse_model_spec(cfg), args.rows
    mb, hidden, e, inter = spec.mamba, spec.hidden_size, cfg["num_local_experts"], cfg["intermediate_size"]
    torch.manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16, scale=0.02):
        return torch.randn(*shape, device="cuda", dtype=dtype) * scale

    x, u = rnd(m, hidden, scale=1), rnd(m, mb.intermediate_size, scale=1)
    w_in, w_out = rnd(mb.intermediate_size + mb.conv_dim + mb.num_heads, hidden), rnd(hidden, mb.intermediate_size)
    experts = rnd(e, 2 * inter, hidden), rnd(e, hidden, inter)
    shared = rnd(2 * cfg["shared_intermediate_size"], hidden), rnd(hidden, cfg["shared_intermediate_size"])
    logits = rnd(m, e, scale=1)
    heads, groups = mb.num_heads, mb.n_groups
    pool = rnd(m, heads, mb.head_dim, mb.state_size, dtype=torch.float32, scale=1)
    slots = torch.arange(m, device="cuda")
    xs, dt = rnd(m, heads, mb.head_dim, scale=1), rnd(m, heads, scale=1)
    b, c = rnd(m, groups, mb.state_size, scale=1), rnd(m, groups, mb.state_size, scale=1)
    zeros, ones = torch.zeros(heads, device="cuda"), torch.ones(heads, device="cuda")
    for _ in range(2):
        linear.linear(x, w_in)
        linear.linear(u, w_out)
        moe.softmax_topk_experts(x, logits, cfg["num_experts_per_tok"], *experts, F.silu, True, shared)
        ssd.ssd_state_update(pool, slots, xs, dt, zeros, (0.0, float("inf")), zeros, b, c, ones)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
