"""Mixture-of-experts routing and expert compute, torch reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def route_softmax_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Granite: top-k of the logits, softmax over the chosen k. Returns (weights, ids) [T, k]."""
    top_logits, ids = router_logits.float().topk(top_k, dim=-1)
    return torch.softmax(top_logits, dim=-1), ids


def route_softmax_all_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen MoE: softmax over every expert, the top k of it, optionally renormalized to sum 1.
    Returns (weights float32, ids) [T, k]."""
    weights, ids = torch.softmax(router_logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights), ids


def softmax_topk_experts(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    gated: bool,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Granite's routing (`route_softmax_topk`) and `moe_experts` as one op, so that a fast path can
    route and sort the routed pairs in one launch."""
    weights, ids = route_softmax_topk(router_logits, top_k)
    return moe_experts(x, w_in, w_out, weights, ids, act, gated, shared)


def route_sigmoid_grouped(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nemotron-H / DeepSeek-V3: sigmoid scores, bias-corrected choice within the best groups."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    num_experts = scores.shape[-1]
    group_scores = choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    expert_mask = group_mask[:, :, None].expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
    ids = choice.masked_fill(expert_mask == 0, -torch.inf).topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling, ids


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def expert_mlp(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], gated: bool) -> torch.Tensor:
    """One expert: w_out act(w_in x), or w_out (act(gate) * up) with [gate | up] = w_in x."""
    h = F.linear(x, w_in)
    if gated:
        gate, up = h.chunk(2, dim=-1)
        h = act(gate) * up
    else:
        h = act(h)
    return F.linear(h, w_out)


def moe_experts(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    gated: bool,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H]; w_in [E, I or 2I, H]; w_out [E, H, I]. Gated experts compute act(gate) * up
    from the two halves of w_in's output. Accumulates the routed experts in float32.
    `shared` (w_in [Is or 2Is, H], w_out [H, Is]): an always-on expert of the same kind whose
    output is added to the routed sum (Granite's shared MLP, Nemotron-H's shared experts)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        token_idx, k_pos = torch.where(ids == e)
        h = expert_mlp(x[token_idx], w_in[e], w_out[e], act, gated) * weights[token_idx, k_pos, None].to(x.dtype)
        out.index_add_(0, token_idx, h.float())
    out = out.to(x.dtype)
    return out if shared is None else out + expert_mlp(x, *shared, act, gated)
