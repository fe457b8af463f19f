"""The one dispatch point between layers and kernels.

Layers call `kernels().<op>`; the engine picks the set once at start-up. Every op of a fast set
has the signature and semantics of the torch reference of the same name, and a test comparing
the two on random inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from engram.ops import attention, conv, moe, norm, ssd


@dataclass(frozen=True)
class KernelSet:
    name: str
    ssd_varlen: Callable = ssd.ssd_varlen
    ssd_state_update: Callable = ssd.ssd_state_update
    causal_conv1d_varlen: Callable = conv.causal_conv1d_varlen
    causal_conv1d_update: Callable = conv.causal_conv1d_update
    rms_norm: Callable = norm.rms_norm
    gated_rms_norm: Callable = norm.gated_rms_norm
    store_kv: Callable = attention.store_kv
    paged_attention: Callable = attention.paged_attention
    moe_experts: Callable = moe.moe_experts


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
        return replace(REFERENCE, name="cuda", **cuda_kernels.available())
    return REFERENCE
