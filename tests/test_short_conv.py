"""LFM2's short conv layer on a decode step padded as a CUDA graph pads it: rows of slot -1 (and
garbage inputs) beside the real ones. The padding must change neither a real row's output nor any
slot's state, the last slot included (which a slot of -1 indexes in a plain gather/scatter)."""

from __future__ import annotations

import torch

from engram.cache.forward_batch import ForwardBatch
from engram.layers.short_conv import ShortConv
from engram.models.spec import ShortConvSpec


class _States:
    """The one layer's conv window of every slot, as `StateCache`."""

    def __init__(self, conv: torch.Tensor):
        self.conv = conv

    def of(self, layer: int, suffix: str) -> torch.Tensor:
        assert (layer, suffix) == (0, "conv")
        return self.conv


class _NoKV:
    block_size = 16
    k: dict[int, torch.Tensor] = {}
    v: dict[int, torch.Tensor] = {}


def _decode(layer: ShortConv, hidden: torch.Tensor, slots: list[int], conv: torch.Tensor) -> torch.Tensor:
    n = len(slots)
    none = torch.empty(0, dtype=torch.long)
    batch = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.full((n,), 5),
        seq_lens=[1] * n,
        context_lens=[5] * n,
        state_slots=torch.tensor(slots),
        slot_mapping=none,
        block_tables=none.view(n, 0),
        logits_indices=torch.arange(n),
        state_pool=_States(conv),
        kv_pool=_NoKV(),
    )
    assert batch.is_decode
    return layer(hidden, batch)


def test_padded_decode_rows_leave_every_real_slot_as_the_unpadded_step():
    torch.manual_seed(0)
    layer = ShortConv(ShortConvSpec(hidden_size=16, conv_kernel=3, bias=True), layer_index=0)
    conv = torch.randn(4, 2, 16)  # 4 slots of windows of earlier tokens; slot 1 is in no batch
    real_slots = [3, 0, 2]  # the last slot among them
    hidden = torch.randn(3, 16)
    with torch.no_grad():
        unpadded_conv = conv.clone()
        expected = _decode(layer, hidden, real_slots, unpadded_conv)
        padded_conv = conv.clone()
        padded_hidden = torch.cat([hidden[:1], torch.randn(1, 16), hidden[1:], torch.randn(2, 16)])
        got = _decode(layer, padded_hidden, [3, -1, 0, 2, -1, -1], padded_conv)
    # equal up to the rounding of a projection over 6 rows instead of 3
    torch.testing.assert_close(got[[0, 2, 3]], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(padded_conv, unpadded_conv, rtol=1e-6, atol=1e-6)
    assert torch.equal(padded_conv[1], conv[1]) and not torch.equal(padded_conv[3], conv[3])
