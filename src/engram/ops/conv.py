"""Depthwise causal conv1d with a carried state (Mamba2's short convolution), torch reference.

x [L, C], weight [C, K], conv state [K-1, C]: the last K-1 inputs before x. SiLU applied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. Returns (silu(conv(x)) [L, C], new conv state [K-1, C])."""
    window = torch.cat([conv_state.to(x.dtype), x], dim=0)  # [K-1+L, C]
    y = F.conv1d(window.t()[None], weight[:, None, :], bias, groups=weight.shape[0])[0].t()
    return F.silu(y), window[window.shape[0] - conv_state.shape[0] :]


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of S sequences: x [S, C], conv_state [S, K-1, C]."""
    window = torch.cat([conv_state.to(x.dtype), x[:, None]], dim=1)  # [S, K, C]
    y = torch.einsum("skc,ck->sc", window, weight.to(x.dtype))
    if bias is not None:
        y = y + bias
    return F.silu(y), window[:, 1:]


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seq_lens: list[int], conv_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat batch: x [T, C] split by seq_lens, conv_states [S, K-1, C]."""
    ys, states = zip(*(causal_conv1d(xi, weight, bias, conv_states[i]) for i, xi in enumerate(x.split(seq_lens))))
    return torch.cat(ys), torch.stack(states)
