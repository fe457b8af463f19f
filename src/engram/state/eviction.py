"""Which cached state leaves first: the one whose bytes save the least prefill compute, recency
weighed in (Marconi, MLSys 2025). A state after n tokens saves the prefill of those n tokens;
for a hybrid model that is a linear term (every layer's projections) plus a quadratic one
(attention over the prefix), while its bytes are the recurrent state (fixed) plus the prefix's KV
(linear). So of two states of the same size the one after the longer prefix saves more, and
least-recently-used order, which ignores this, throws away the most valuable states of a long
conversation as readily as a short prompt's.

Score = recency + alpha * FLOPs saved per byte, each min-max normalized over the entries; the
lowest leaves (ties: the least recently used).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engram.models.spec import ModelSpec


@dataclass(frozen=True)
class PrefillCost:
    """FLOPs of a prefill of n tokens: `per_token * n + per_pair * n * (n + 1) / 2` (causal pairs).
    `of` counts the sequence mixers (Mamba2, gated DeltaNet and KDA projections and scans, short convs, attention
    projections, scores and values); the feed-forward layers are left out (the spec does not size them), which
    understates the linear term alike for every entry of a model."""

    per_token: float
    per_pair: float = 0.0

    @classmethod
    def of(cls, spec: ModelSpec) -> PrefillCost:
        h, per_token, per_pair = spec.hidden_size, 0.0, 0.0
        if spec.mamba is not None:
            m = spec.mamba
            projections = h * (m.intermediate_size + m.conv_dim + m.num_heads) + m.intermediate_size * h
            scan = 4 * m.num_heads * m.head_dim * m.state_size
            per_token += len(spec.mamba_layers) * (2 * projections + scan)
        if spec.gated_deltanet is not None:
            g = spec.gated_deltanet
            projections = h * g.in_proj_size + g.value_dim * h
            scan = 6 * g.num_v_heads * g.head_k_dim * g.head_v_dim  # decay, read, write and output of the state
            per_token += len(spec.gated_deltanet_layers) * (2 * projections + scan)
        if spec.kda is not None:
            d = spec.kda
            projections = h * d.in_proj_size + 2 * d.head_dim * d.qkv_dim + d.qkv_dim * h  # in, decay and gate up-projections, out
            scan = 6 * d.num_heads * d.head_dim * d.head_dim
            per_token += len(spec.kda_layers) * (2 * projections + scan)
        if spec.short_conv is not None:
            c = spec.short_conv
            projections = h * 3 * h + h * h  # in_proj (B, C, x) and out_proj
            per_token += len(spec.short_conv_layers) * (2 * projections + 2 * c.conv_kernel * h + 2 * h)  # conv taps, two gates
        if spec.attention is not None:
            a = spec.attention
            projections = h * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim + a.num_heads * a.head_dim * h
            per_token += len(spec.attention_layers) * 2 * projections
            per_pair += len(spec.attention_layers) * 4 * a.num_heads * a.head_dim  # q.k and p.v
        return cls(per_token, per_pair)

    def flops(self, tokens: int) -> float:
        return self.per_token * tokens + self.per_pair * tokens * (tokens + 1) / 2


@dataclass(frozen=True)
class Candidate:
    key: bytes
    tokens: int  # the prefix the state covers (its state_len)
    nbytes: int
    last_use: float


@dataclass(frozen=True)
class ComputeSavedPolicy:
    cost: PrefillCost = PrefillCost(per_token=1.0)
    alpha: float = 1.0  # weight of compute saved per byte against recency

    def victim(self, entries: Sequence[Candidate], keep: bytes | None = None) -> bytes | None:
        """The key of the entry to evict among `entries` (all of them: the scores are relative),
        never `keep` (the entry just admitted); None if there is no other."""
        if not any(e.key != keep for e in entries):
            return None
        recency = _normalized([e.last_use for e in entries])
        value = _normalized([self.cost.flops(e.tokens) / max(e.nbytes, 1) for e in entries])
        scored = [(r + self.alpha * v, e.last_use, e.key) for e, r, v in zip(entries, recency, value) if e.key != keep]
        return min(scored)[2]


def _normalized(values: list[float]) -> list[float]:
    low, high = min(values), max(values)
    return [(v - low) / (high - low) if high > low else 0.0 for v in values]
