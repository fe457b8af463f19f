"""Causal attention over a paged KV cache (prefill chunks and decode, GQA), torch reference.

The cache of one layer is [num_slots, kv_heads, head_dim]; a token at position p of a sequence
lives at slot `block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

import torch


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    k_cache[slot_mapping] = k.to(k_cache.dtype)
    v_cache[slot_mapping] = v.to(v_cache.dtype)


def token_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..length-1 of one sequence."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: list[int],
    context_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    scaling: float,
    cu_seqlens: torch.Tensor | None = None,
    context_lens_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] holds seq_lens[i] new tokens per sequence, whose KV is already stored.

    Each new token at position context_lens[i] + j attends to positions 0..context_lens[i] + j.
    `cu_seqlens` / `context_lens_t` are the same lengths as device tensors, for fast kernels (a
    decode step in a CUDA graph reads only those); unused here."""
    out = torch.empty_like(q)
    n_rep = q.shape[1] // k_cache.shape[1]
    start = 0
    for i, (n, ctx) in enumerate(zip(seq_lens, context_lens)):
        total = ctx + n
        slots = token_slots(block_tables[i], total, block_size)
        k = k_cache[slots].to(q.dtype).repeat_interleave(n_rep, dim=1)  # [total, Hq, D]
        v = v_cache[slots].to(q.dtype).repeat_interleave(n_rep, dim=1)
        qi = q[start : start + n]
        scores = torch.einsum("thd,shd->hts", qi, k) * scaling
        causal = torch.arange(total, device=q.device)[None] <= (ctx + torch.arange(n, device=q.device))[:, None]
        scores = scores.masked_fill(~causal[None], -torch.inf)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[start : start + n] = torch.einsum("hts,shd->thd", probs, v)
        start += n
    return out
