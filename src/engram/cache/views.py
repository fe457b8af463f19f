"""The per-layer cache views: the recurrent state and the paged attention KV as layers see them.

Layers read and write these tensors in place, by a batch's state slots and KV slot mapping; who
allocates them (the engine's pools, engine/pools.py) is none of their concern.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch


class StateCache(Protocol):
    """Every recurrent layer's declared state tensors, by slot."""

    def of(self, layer: int, suffix: str) -> torch.Tensor:
        """Layer `layer`'s `suffix` state for all slots: [num_slots, *shape]."""
        ...


class KVCache(Protocol):
    """Every attention layer's K and V in pages of `block_size` tokens: [num_pages * block_size, kv_heads, head_dim]."""

    @property
    def block_size(self) -> int: ...

    @property
    def k(self) -> Mapping[int, torch.Tensor]: ...

    @property
    def v(self) -> Mapping[int, torch.Tensor]: ...
