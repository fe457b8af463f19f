"""The CUDA fast path: which fast op serves which reference op.

- Triton kernels of this package (engram.ops.triton_ops, a module per op family): linear layers
  at decode batch sizes (a GEMV reading each weight once for all rows; for Mamba2's in_proj with
  the conv update of its xBC columns in the same launch), RMS norms (alone and fused with the
  residual add before them), gated RMS norm, SiLU-and-mul, the single-token SSD state update and
  causal-conv update (in place in the state pool, by slot; up to LINEAR_GEMV_MAX_ROWS rows the
  update also applies Mamba2's gate and norm weight, and the output projection's GEMV the norm's
  row statistic), a speculative verify step's conv (with or without the SiLU), SSD and gated
  delta rule (every position's state kept, one launch each), the varlen causal conv1d (both
  convs with Mamba2's SiLU, or without it as LFM2's short conv), KV store, paged attention
  (prefill with context and decode), router top-k and the fused MoE (per-pair GEMV at small
  batch, grouped GEMM over the expert-sorted routed tokens above), the greedy token's argmax over
  the vocabulary, and a decode graph's inputs taken from pinned host memory.
- fla-core (optional, the `cuda` extra): Mamba2 chunked prefill through `chunk_simple_gla`, which
  computes SSD exactly with q=C, k=B, v=x*dt, g=A*dt, scale=1 and the groups repeated to heads,
  over `cu_seqlens` with initial states read from the state pool, for sequences longer than
  SSD_SCAN_MAX_LEN tokens. Shorter ones (with the default 2,048-token chunk, every prefill chunk)
  take a token-by-token Triton scan instead: one launch and no host work, where fla-core waits for
  the device in every layer (a split count read with `.item()`), ~80 ms per forward on the H200;
  without fla-core every prefill takes that scan.
- gated delta rule (Qwen3-Next / Qwen3.5): decode and sequences up to GDN_RECURRENT_MAX_LEN tokens
  by this package's token-by-token kernel (triton_ops/gated_delta.py: states read and written in
  the pool by slot, no host work, so decode, prefill and verify graphs can hold it; its VERIFY
  variant keeps every position's state instead of writing the pool); longer prefills through
  fla-core's `chunk_gated_delta_rule` over `cu_seqlens`, with the states gathered from the pool by
  slot and written back (the token-by-token kernel without fla-core). Kimi Delta Attention (a
  decay per key channel) takes the same kernel's PER_CHANNEL variant and fla-core's `chunk_kda`.

Importing this module raises ImportError when Triton is missing; `dispatch.select_kernels`
then keeps the references.
"""

from __future__ import annotations

import warnings
from functools import partial

import torch

from engram.ops import ssd as ssd_ref
from engram.ops.triton_ops import attention, common, conv, gated_delta, linear, moe, norm, sample, ssd, staging

try:  # optional dependency
    from fla.ops.simple_gla import chunk_simple_gla as _chunk_simple_gla
except Exception:  # noqa: BLE001 - any failure to import means "not available"
    _chunk_simple_gla = None
try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _chunk_gdr
except Exception:  # noqa: BLE001
    _chunk_gdr = None
try:
    from fla.ops.kda import chunk_kda as _chunk_kda
except Exception:  # noqa: BLE001
    _chunk_kda = None

# Up to this many tokens per sequence the token-by-token kernel serves prefill: at least the longest
# prefill graph (engine/runner.py, 128 tokens), which fla-core's host work could not be captured in.
GDN_RECURRENT_MAX_LEN = 128

# fla warns when a short prefill has fewer tokens than heads (it suspects head-first inputs).
warnings.filterwarnings("ignore", message="Input tensor shape suggests potential format mismatch")


def has_fla() -> bool:
    return _chunk_simple_gla is not None


_fla_lengths: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None


def _fla_cu_seqlens(seq_lens: list[int], cu_seqlens: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's cu_seqlens for fla (int64 on the device, and on the host), the same objects for
    every layer of one forward: fla caches its chunk indices by argument identity, and building them
    anew copies them from pageable host memory, which waits for the stream, once per layer."""
    global _fla_lengths
    if _fla_lengths is None or cu_seqlens is None or _fla_lengths[0] is not cu_seqlens:
        cu = common.cu_seqlens_of(seq_lens, device) if cu_seqlens is None else cu_seqlens
        _fla_lengths = (cu_seqlens, cu.to(torch.int64), torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int64))
    return _fla_lengths[1], _fla_lengths[2]


def ssd_varlen_fla(x, dt, dt_bias, dt_limit, A_log, B, C, D, chunk_size, seq_lens, ssm_pool, slots, cu_seqlens=None):
    """Mamba2 SSD over a flat varlen batch via fla's chunked simple-GLA kernels.

    SSD: h_t = exp(dt_t A) h_{t-1} + (x_t dt_t) B_t^T, y_t = h_t C_t + D x_t. simple-GLA:
    S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = scale q_t S_t. So q=C, k=B, v=x*dt, g=A*dt, scale=1;
    fla's state [K=N, V=P] is the transpose of the pool's [P, N]."""
    T, H, P = x.shape
    G = B.shape[1]
    dtf, A = ssd_ref.discretize(dt, dt_bias, dt_limit, A_log)
    dtype = x.dtype
    q = C.to(dtype).repeat_interleave(H // G, dim=1)
    k = B.to(dtype).repeat_interleave(H // G, dim=1)
    v = (x.float() * dtf[..., None]).to(dtype)
    g = dtf * A[None]
    cu, cu_cpu = _fla_cu_seqlens(seq_lens, cu_seqlens, x.device)
    initial = ssm_pool[slots].to(torch.float32).transpose(-1, -2).contiguous()  # [S, H, N, P]
    o, final = _chunk_simple_gla(
        q[None],
        k[None],
        v[None],
        g=g[None],
        scale=1.0,
        initial_state=initial,
        output_final_state=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
    )
    ssm_pool[slots] = final.transpose(-1, -2).to(ssm_pool.dtype)
    return o[0].float() + x.float() * D.float()[:, None]


def ssd_varlen(x, dt, dt_bias, dt_limit, A_log, B, C, D, chunk_size, seq_lens, ssm_pool, slots, cu_seqlens=None):
    """Short sequences (a resumed turn, small prefill chunks): the token-by-token Triton scan, one
    launch. Long ones: fla-core's chunked kernels (the scan when fla-core is missing)."""
    if not has_fla() or max(seq_lens, default=0) <= ssd.SSD_SCAN_MAX_LEN:
        return ssd.ssd_varlen_scan(x, dt, dt_bias, dt_limit, A_log, B, C, D, chunk_size, seq_lens, ssm_pool, slots, cu_seqlens)
    return ssd_varlen_fla(x, dt, dt_bias, dt_limit, A_log, B, C, D, chunk_size, seq_lens, ssm_pool, slots, cu_seqlens)


def gated_delta_varlen(q, k, v, g, beta, seq_lens, state_pool, slots, chunk_size=64, l2_norm_qk=False, scale=None, cu_seqlens=None):
    """Short sequences: the token-by-token kernel. Long ones: fla-core's chunked kernels (fla's
    chunk size is its own; the chunking does not change the result), KDA's for a per-channel g."""
    chunked = _chunk_kda if g.dim() == 3 else _chunk_gdr
    if chunked is None or max(seq_lens, default=0) <= GDN_RECURRENT_MAX_LEN:
        return gated_delta.gated_delta_varlen_scan(q, k, v, g, beta, seq_lens, state_pool, slots, chunk_size, l2_norm_qk, scale, cu_seqlens)
    if cu_seqlens is None:
        cu_seqlens = common.cu_seqlens_of(seq_lens, q.device)
    cu_cpu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int64)
    o, final = chunked(
        q[None],
        k[None],
        v[None].to(q.dtype),
        g=g[None].float(),
        beta=beta[None].to(q.dtype),
        scale=scale,
        initial_state=state_pool[slots].float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2_norm_qk,
        cu_seqlens=cu_seqlens.to(torch.int64),
        cu_seqlens_cpu=cu_cpu,
    )
    state_pool[slots] = final.to(state_pool.dtype)
    return o[0].float()


def available() -> dict:
    """Fields of a KernelSet: the name and the fast ops."""
    ops = dict(
        name="cuda-triton" + ("+fla" if has_fla() else ""),
        ssd_varlen=ssd_varlen,
        gated_delta_varlen=gated_delta_varlen,
        gated_delta_state_update=gated_delta.gated_delta_state_update,
        gated_delta_verify=gated_delta.gated_delta_verify,
        causal_conv1d_varlen=conv.causal_conv1d_varlen,
        linear_conv_update=linear.linear_conv_update,
        short_conv1d_varlen=partial(conv.causal_conv1d_varlen, silu=False),
        short_conv1d_update=partial(conv.causal_conv1d_update, silu=False),
        short_conv1d_verify=partial(conv.causal_conv1d_verify, silu=False),
        ssd_state_update=ssd.ssd_state_update,
        ssd_state_update_norm_linear=ssd.ssd_state_update_norm_linear,
        ssd_verify=ssd.ssd_verify,
        causal_conv1d_verify=conv.causal_conv1d_verify,
        linear=linear.linear,
        rms_norm=norm.rms_norm,
        add_rms_norm=norm.add_rms_norm,
        add_rms_norm_linear=norm.add_rms_norm_linear,
        gated_rms_norm=norm.gated_rms_norm,
        silu_and_mul=norm.silu_and_mul,
        store_kv=attention.store_kv,
        paged_attention=attention.paged_attention,
        moe_experts=moe.moe_experts,
        softmax_topk_experts=moe.softmax_topk_experts,
        argmax=sample.argmax,
        take_decode_inputs=staging.take_decode_inputs,
        graph_safe_decode=True,
    )
    return ops
