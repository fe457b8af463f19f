"""Block sizes of the small-batch kernels, measured on an H200 with benchmarks/tune_gemv.py and
benchmarks/tune_in_model.py (the MoE GEMVs and the single-row GEMVs inside the decode step at batch 1;
the tensor-core and grouped kernels at batch 64).

- GEMVs: (BLOCK_N, BLOCK_K, num_warps).
- The linear layers' tensor-core kernel: (BLOCK_N, BLOCK_K, num_warps, num_stages), for layers wide
  enough to give every SM a program at that BLOCK_N ("linear_dot") and for narrower ones, up to 32 rows
  and at 33-64.
- The grouped MoE GEMM, up to MOE_GROUPED_SMALL_PAIRS routed pairs: (BLOCK_M, BLOCK_N, BLOCK_K,
  num_warps, num_stages) for the up projection and (BLOCK_N, BLOCK_K, num_warps, num_stages) for
  the down projection.
"""

from __future__ import annotations

GEMV_CONFIG = {
    "linear": (2, 1024, 1),
    "linear_row": (4, 1024, 1),
    "linear_row_long_k": (2, 4096, 1),
    "linear_dot": (32, 128, 4, 4),
    "linear_dot_narrow": (16, 256, 4, 4),
    "linear_dot_narrow_64": (16, 128, 4, 8),
    "moe_up": (2, 2048, 2),
    "moe_down": (2, 512, 1),
    "moe_grouped_up": (16, 32, 64, 4, 3),
    "moe_grouped_down": (32, 128, 2, 3),
}
