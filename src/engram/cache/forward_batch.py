"""What one model forward sees: a flat batch of tokens from several sequences plus their caches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.cache.views import KVCache, StateCache


@dataclass
class VerifyStates:
    """A speculative verify step's recurrent states at every position, by (layer, state suffix)
    (ops/verify.py): the recurrent layers fill these instead of writing the pool, and the engine
    commits the one after each sequence's accepted tokens (engine/speculative.py). Every declared
    state tensor has one buffer (`StateTensor.verify_shape`): a conv window or per-position states."""

    windows: dict[tuple[int, str], torch.Tensor]  # [S, K-1 + L, C]: the old conv state, then the step's inputs
    states: dict[tuple[int, str], torch.Tensor]  # [S, L, *shape]: a scan's state after each position
    rows: torch.Tensor  # [S, L] int64: each position's row of the flat batch (past a sequence's length: its last)
    flat: torch.Tensor  # [T] int64: each flat row's place in the [S * L] layout

    def narrowed(self, num_seqs: int, length: int, rows: torch.Tensor, flat: torch.Tensor) -> VerifyStates:
        """Views of these buffers for a step of num_seqs sequences and `length` positions, with its layout."""
        unused = self.rows.shape[1] - length
        windows = {key: w[:num_seqs, : w.shape[1] - unused] for key, w in self.windows.items()}
        return VerifyStates(windows, {key: t[:num_seqs, :length] for key, t in self.states.items()}, rows, flat)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] all new tokens of the step, sequence after sequence
    positions: torch.Tensor  # [T] position of each token in its sequence
    seq_lens: list[int]  # new tokens per sequence (host data)
    context_lens: list[int]  # tokens each sequence had consumed before this step (host data)
    state_slots: torch.Tensor  # [S] state cache slot of each sequence (-1: a padding row of a CUDA graph)
    slot_mapping: torch.Tensor  # [T] KV cache slot each new token is written to (-1: padding)
    block_tables: torch.Tensor  # [S, max_blocks] KV pages of each sequence (-1 padded)
    logits_indices: torch.Tensor  # rows of the flat batch whose next-token logits are needed
    state_pool: StateCache
    kv_pool: KVCache
    # The lengths again as device tensors, for kernels that must not read host data (a decode
    # step replayed from a CUDA graph sees only these): int64 [S + 1] and int64 [S].
    cu_seqlens: torch.Tensor | None = None
    context_lens_t: torch.Tensor | None = None
    verify: VerifyStates | None = None  # a speculative step: recurrent layers keep every position's state

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds exactly one token on top of an existing state."""
        return self.verify is None and all(n == 1 for n in self.seq_lens) and all(c > 0 for c in self.context_lens)
