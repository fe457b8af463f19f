"""Feed-forward blocks: plain and gated MLPs, and mixtures of experts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engram.layers import parallel
from engram.layers.linear import Linear
from engram.layers.norm import RMSNorm
from engram.layers.parallel import Range, Shard, TensorParallel, even
from engram.ops.dispatch import kernels
from engram.ops.moe import route_sigmoid_grouped, route_softmax_all_topk


class _Sharded(nn.Module):
    """A block whose intermediate channels are split over the tensor-parallel ranks (each keeps
    `width / size` of them), its output summed over the ranks."""

    def _local_width(self, width: int) -> int:
        self.tp: TensorParallel | None = parallel.current()
        self.full_width = width
        return width if self.tp is None else parallel.split(width, f"{type(self).__name__} intermediate size", self.tp.size)

    def _inner(self, parts: int = 1) -> tuple[Range, ...]:
        """This rank's channels of each of `parts` consecutive blocks of the full width."""
        assert self.tp is not None
        w = self.full_width
        return tuple(even(w, self.tp.rank, self.tp.size, i * w) for i in range(parts))

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.tp is None else self.tp.all_reduce(out)


class GatedMLP(_Sharded):
    """down(act(gate(x)) * up(x)) with separate gate/up projections (Bamba)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        intermediate_size = self._local_width(intermediate_size)
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def tp_shards(self) -> dict[str, Shard]:
        assert self.tp is not None
        out = self.down_proj.out_features
        return parallel.linear_shards(self.tp.rank, self._inner(), ("gate_proj", "up_proj"), ("down_proj",), out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(self.partial_sum(x))

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output (all of it without tensor parallelism), for a block that
        sums it with its own terms before one all-reduce."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(_Sharded):
    """Gate and up in one projection, split in halves (Granite's shared MLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        intermediate_size = self._local_width(intermediate_size)
        self.input_linear = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = Linear(intermediate_size, hidden_size, bias=False)

    def tp_shards(self) -> dict[str, Shard]:
        assert self.tp is not None
        return parallel.linear_shards(self.tp.rank, self._inner(2), column=("input_linear",)) | parallel.linear_shards(
            self.tp.rank, self._inner(), row=("output_linear",)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(self.output_linear(kernels().silu_and_mul(self.input_linear(x))))

    def as_shared_expert(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_linear.weight, self.output_linear.weight


class PlainMLP(_Sharded):
    """down(act(up(x))) (Nemotron-H, relu^2)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: Callable[[torch.Tensor], torch.Tensor], bias: bool = False):
        super().__init__()
        intermediate_size = self._local_width(intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = act

    def tp_shards(self) -> dict[str, Shard]:
        assert self.tp is not None
        return parallel.linear_shards(self.tp.rank, self._inner(), ("up_proj",), ("down_proj",), self.down_proj.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(self.down_proj(self.act(self.up_proj(x))))

    def as_shared_expert(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Its weights for `moe_experts(shared=...)`; None when biases keep it a separate MLP."""
        if self.up_proj.bias is not None or self.down_proj.bias is not None:
            return None
        return self.up_proj.weight, self.down_proj.weight


class _Router(nn.Module):
    """Holds the router's projection under the checkpoint's name (`router.layer`)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.layer = Linear(hidden_size, num_experts, bias=False)


class _Gate(nn.Module):
    """The sigmoid router's weight and correction bias under the checkpoint's names (`gate.*`)."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))


class SoftmaxTopKMoE(_Sharded):
    """Granite MoE: softmax over the top-k router logits, gated SiLU experts, plus the block's
    shared MLP computed with them (one set of kernels for both). It takes the block's residual
    stream and applies the norm before it itself, in the same op as the router."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int):
        super().__init__()
        intermediate_size = self._local_width(intermediate_size)
        self.top_k = top_k
        self.router = _Router(hidden_size, num_experts)
        self.input_linear = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.output_linear = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, residual_scale: float, shared_mlp: FusedGatedMLP
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MoE(norm(stream)), stream) for stream = residual + x * residual_scale."""
        assert not norm.weight_in_fp32, "add_rms_norm_linear applies the norm weight after the cast (Granite's norm)"
        k = kernels()
        h, residual, logits = k.add_rms_norm_linear(x, residual, norm.weight, norm.eps, residual_scale, self.router.layer.weight)
        shared = shared_mlp.as_shared_expert()
        out = k.softmax_topk_experts(h, logits, self.top_k, self.input_linear, self.output_linear, F.silu, True, shared)
        return self._reduce(out), residual

    def tp_shards(self) -> dict[str, Shard]:
        """Tensor-parallel inside each expert: its gate and up rows, its down columns (the router is whole)."""
        return {"input_linear": Shard(-2, self._inner(2)), "output_linear": Shard(-1, self._inner())}


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3's expert choice (Nemotron-H, Kimi-Linear): sigmoid scores; with the correction
    bias added, the best `topk_group` of `n_group` groups by their two best scores, the top k within
    them; their scores renormalized when `norm_topk_prob`, times `routed_scaling`."""

    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0

    @classmethod
    def from_config(cls, cfg: dict, routed_scaling: float = 1.0) -> GroupedRouting:
        """From DeepSeek-V3's field names, which both configs use; `routed_scaling`: the
        architecture's default where the config has no routed_scaling_factor (transformers')."""
        return cls(
            cfg["num_experts_per_tok"],
            cfg.get("n_group") or 1,
            cfg.get("topk_group") or 1,
            bool(cfg.get("norm_topk_prob", True)),
            float(cfg.get("routed_scaling_factor", routed_scaling)),
        )


class SigmoidGroupedMoE(_Sharded):
    """MoE with `GroupedRouting` plus always-on shared experts: relu^2 experts beside a plain shared
    MLP (Nemotron-H), or gated SiLU experts (gate and up stacked in `up_proj`) beside a gated one
    (Kimi-Linear)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        routing: GroupedRouting,
        act: Callable[[torch.Tensor], torch.Tensor],
        shared_experts: PlainMLP | GatedMLP,
        gated: bool = False,
    ):
        super().__init__()
        inter = self._local_width(intermediate_size)
        self.routing, self.act, self.gated = routing, act, gated
        self.gate = _Gate(hidden_size, num_experts)
        self.up_proj = nn.Parameter(torch.empty(num_experts, (2 if gated else 1) * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.routing
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = route_sigmoid_grouped(
            logits, self.gate.e_score_correction_bias, r.top_k, r.n_group, r.topk_group, r.norm_topk_prob, r.routed_scaling
        )
        shared = self.shared_experts.as_shared_expert() if isinstance(self.shared_experts, PlainMLP) else None
        out = self._reduce(kernels().moe_experts(x, self.up_proj, self.down_proj, weights, ids, self.act, self.gated, shared))
        return out if shared is not None else out + self.shared_experts(x)

    def tp_shards(self) -> dict[str, Shard]:
        """Tensor-parallel inside each expert (the router and its bias are whole)."""
        return {"up_proj": Shard(-2, self._inner(2 if self.gated else 1)), "down_proj": Shard(-1, self._inner())}


class _Experts(nn.Module):
    """Stacked expert weights under the checkpoint's names (`experts.gate_up_proj`, `experts.down_proj`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SharedExpertGateMoE(_Sharded):
    """Qwen3-Next / Qwen3.5 MoE: softmax over every expert's logit, the top k (renormalized when
    `norm_topk_prob`), gated SiLU experts, plus a gated MLP shared expert scaled by
    sigmoid(shared_expert_gate(x)). Tensor-parallel inside each expert and the shared expert; the
    router and the shared expert's gate are whole, so the scaled sum is reduced once."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool, shared_intermediate_size: int):
        super().__init__()
        intermediate_size = self._local_width(intermediate_size)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = _Experts(hidden_size, intermediate_size, num_experts)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def tp_shards(self) -> dict[str, Shard]:
        """The stacked experts' rows and columns, and those of one expert's gate or up projection
        (`experts.gate_proj` / `experts.up_proj`: the checkpoints' per-expert halves of gate_up_proj)."""
        half = Shard(-2, self._inner())
        return {
            "experts.gate_up_proj": Shard(-2, self._inner(2)),
            "experts.down_proj": Shard(-1, self._inner()),
            "experts.gate_proj": half,
            "experts.up_proj": half,
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_softmax_all_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        routed = kernels().moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, F.silu, True)
        return self._reduce(routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial_sum(x))
