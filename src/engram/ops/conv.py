"""Depthwise causal conv1d with a carried state (Mamba2's short convolution), torch reference.

x [L, C], weight [C, K], conv state [K-1, C]: the last K-1 inputs before x. SiLU applied unless
`silu=False` (LFM2's short convolution has no activation).

The batch ops read and write the state in place, in the pool `[num_slots, K-1, C]` at the
sequences' slots (so a fast kernel never gathers or scatters whole states). A slot of -1 (a CUDA
graph's padding row) reads a zero state and writes nothing, as the fast kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. Returns (silu(conv(x)) [L, C], new conv state [K-1, C])."""
    window = torch.cat([conv_state.to(x.dtype), x], dim=0)  # [K-1+L, C]
    y = F.conv1d(window.t()[None], weight[:, None, :], bias, groups=weight.shape[0])[0].t()
    return F.silu(y) if silu else y, window[window.shape[0] - conv_state.shape[0] :]


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of S sequences: x [S, C], conv_state [S, K-1, C] -> (y, new state)."""
    window = torch.cat([conv_state.to(x.dtype), x[:, None]], dim=1)  # [S, K, C]
    y = torch.einsum("skc,ck->sc", window, weight.to(x.dtype))
    if bias is not None:
        y = y + bias
    return F.silu(y) if silu else y, window[:, 1:]


def _states_at(conv_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """conv_pool[slots], zeros for slot -1."""
    return conv_pool[slots.clamp_min(0)].masked_fill((slots < 0)[:, None, None], 0)


def _store_states(conv_pool: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> None:
    """conv_pool[slots] = states, rows of slot -1 left out."""
    real = slots >= 0
    conv_pool[slots[real]] = states[real].to(conv_pool.dtype)


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor, slots: torch.Tensor, silu: bool = True
) -> torch.Tensor:
    """Decode: one token for each of S sequences (x [S, C]); conv_pool[slots] is advanced in place."""
    y, new_state = causal_conv1d_step(x, weight, bias, _states_at(conv_pool, slots), silu)
    _store_states(conv_pool, slots, new_state)
    return y


def linear_conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    conv_start: int,
) -> torch.Tensor:
    """Decode: Mamba2's input projection x W^T (+ b) of one token per sequence, with its columns
    [conv_start, conv_start + C) replaced by their `causal_conv1d_update` (conv_pool[slots]
    advanced in place). Fast kernels do both in one launch."""
    proj = F.linear(x, weight, bias)
    xbc = proj[:, conv_start : conv_start + conv_weight.shape[0]]
    xbc.copy_(causal_conv1d_update(xbc, conv_weight, conv_bias, conv_pool, slots))
    return proj


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: list[int],
    cu_seqlens: torch.Tensor | None = None,
    silu: bool = True,
) -> torch.Tensor:
    """Flat batch: x [T, C] split by seq_lens; conv_pool[slots] is read as the initial states and
    overwritten with the final ones. `cu_seqlens` (device) is for fast kernels; unused here."""
    states = _states_at(conv_pool, slots)
    ys, finals = zip(*(causal_conv1d(xi, weight, bias, states[i], silu) for i, xi in enumerate(x.split(seq_lens))))
    _store_states(conv_pool, slots, torch.stack(finals))
    return torch.cat(ys)
