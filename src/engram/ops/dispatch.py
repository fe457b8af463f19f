"""The one dispatch point between layers and kernels.

Layers call `kernels().<op>`; the engine picks the set once at start-up. Every op of a fast set
has the signature and semantics of the torch reference of the same name, and a test comparing
the two on random inputs (tests/test_gpu_ops.py, on a CUDA machine).

Ops that carry recurrent state take the state pool and the sequences' slots and update the pool
in place; the references do it with gather/scatter, the fast kernels read and write by slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch.nn.functional as F

from engram.ops import activation, attention, conv, gated_delta, moe, norm, sample, ssd, staging, verify


@dataclass(frozen=True)
class KernelSet:
    name: str
    linear: Callable = F.linear
    ssd_varlen: Callable = ssd.ssd_varlen
    ssd_state_update: Callable = ssd.ssd_state_update
    ssd_state_update_norm_linear: Callable = ssd.ssd_state_update_norm_linear
    gated_delta_varlen: Callable = gated_delta.gated_delta_varlen
    gated_delta_state_update: Callable = gated_delta.gated_delta_state_update
    causal_conv1d_varlen: Callable = conv.causal_conv1d_varlen
    linear_conv_update: Callable = conv.linear_conv_update
    # LFM2's short convolution: the same causal conv without the SiLU
    short_conv1d_varlen: Callable = partial(conv.causal_conv1d_varlen, silu=False)
    short_conv1d_update: Callable = partial(conv.causal_conv1d_update, silu=False)
    rms_norm: Callable = norm.rms_norm
    add_rms_norm: Callable = norm.add_rms_norm
    add_rms_norm_linear: Callable = norm.add_rms_norm_linear
    gated_rms_norm: Callable = norm.gated_rms_norm
    norm_then_gate: Callable = norm.norm_then_gate
    silu_and_mul: Callable = activation.silu_and_mul
    silu_gate: Callable = activation.silu_gate
    store_kv: Callable = attention.store_kv
    paged_attention: Callable = attention.paged_attention
    moe_experts: Callable = moe.moe_experts
    softmax_topk_experts: Callable = moe.softmax_topk_experts
    argmax: Callable = sample.argmax
    take_decode_inputs: Callable = staging.take_decode_inputs
    # A speculative step's per-position states and their commit (ops/verify.py): fixed shapes, no
    # host data, so that a verify step of a given (batch, k) can be captured (engine/verify_graphs.py).
    causal_conv1d_verify: Callable = verify.causal_conv1d_verify
    short_conv1d_verify: Callable = partial(verify.causal_conv1d_verify, silu=False)
    ssd_verify: Callable = verify.ssd_verify
    gated_delta_verify: Callable = verify.gated_delta_verify
    commit_windows: Callable = verify.commit_windows
    commit_states: Callable = verify.commit_states
    # Every op a decode step runs is free of host syncs and of data-dependent shapes, and
    # tolerates padding rows (slot -1, context -1): the step can be captured in a CUDA graph.
    graph_safe_decode: bool = False


REFERENCE = KernelSet(name="torch-reference")
_current = REFERENCE


def kernels() -> KernelSet:
    return _current


def use_kernels(kernel_set: KernelSet) -> None:
    global _current
    _current = kernel_set


def select_kernels(device: str, enable_fast_ops: bool) -> KernelSet:
    """Fast CUDA kernels where they are available, else the torch references."""
    if device.startswith("cuda") and enable_fast_ops:
        try:
            from engram.ops import cuda_kernels
        except ImportError:
            return REFERENCE
        ops = cuda_kernels.available()
        if not ops:
            return REFERENCE
        return replace(REFERENCE, **ops)
    return REFERENCE
