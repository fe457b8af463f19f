"""Triton kernels for the CUDA fast path, a module per op family. Each public function has the
signature and semantics of the torch reference of the same name (engram.ops.{conv,ssd,norm,
activation,attention,moe,sample,staging}); tests/test_gpu_ops.py compares them on random inputs.

Kernels that touch recurrent state read and write the pools in place by slot; a slot of -1 (and a
context length of -1 in attention) marks a padding row of a CUDA-graph batch, which reads and
writes nothing. None of these ops syncs with the host or has data-dependent output shapes, so a
decode step can be captured in a CUDA graph.
"""

from engram.ops.triton_ops import attention, blocks, conv, linear, moe, norm, sample, ssd, staging

__all__ = ["attention", "blocks", "conv", "linear", "moe", "norm", "sample", "ssd", "staging"]
