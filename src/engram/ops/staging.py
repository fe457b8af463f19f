"""A decode graph's way in and out, torch reference.

The host stages each replay's inputs in one of two buffers, in turn, and each replay leaves its
tokens in one of two rows of host memory: the host fills the next replay's buffer while the GPU
still runs the last one, and nothing is copied between two replays. `turn` (int64 [3], on the
device) counts the replays: [replays taken, this replay's parity, scratch of the fast kernel (0)].

A staged buffer (int32 words) holds its length n (HEADER_WORDS words, one int64), then n words that
begin with TOKEN_ROW + 1 int64 rows of `columns` each (always staged whole): row 0 the tokens sent,
row TOKEN_ROW each token's row in `sampled` when it is still on the device (the last step sampled it
there), else -1.
"""

from __future__ import annotations

import torch

HEADER_WORDS = 2
TOKEN_ROW = 5


def take_decode_inputs(
    staged: torch.Tensor, inputs: torch.Tensor, turn: torch.Tensor, sampled: torch.Tensor, input_ids: torch.Tensor, columns: int
) -> None:
    """A replay's first op: the words of staged[turn[0] % 2] (int32 [2, HEADER_WORDS + W], W even)
    into inputs[:n] (the words after n are left unspecified), and each of the b = len(input_ids)
    rows' token into input_ids, from `sampled` or as sent; turn[0] goes up by one, turn[1] is this
    replay's parity."""
    parity = turn[:1] % 2
    turn[1:2] = parity
    turn[:1] += 1
    row = staged.index_select(0, parity.to(staged.device))[0]
    inputs.copy_(row[HEADER_WORDS : HEADER_WORDS + inputs.numel()])
    rows = inputs[: 2 * (TOKEN_ROW + 1) * columns].view(torch.int64).view(TOKEN_ROW + 1, columns)
    b = input_ids.shape[0]
    where = rows[TOKEN_ROW, :b]
    input_ids.copy_(torch.where(where >= 0, sampled[where.clamp(min=0)], rows[0, :b]))


def staged_length(staged: torch.Tensor, parity: int) -> torch.Tensor:
    """The length slot of staged[parity] (one int64 over the header's words)."""
    return staged[parity, :HEADER_WORDS].view(torch.int64)
