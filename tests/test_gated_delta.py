"""The gated delta rule ops against the recurrence by definition and transformers' torch functions,
with a decay per head (gated DeltaNet) and per key channel (Kimi Delta Attention)."""

from __future__ import annotations

import pytest
import torch

from engram.ops import gated_delta as gd


def _inputs(length: int, hk=2, hv=4, dk=5, dv=3, seed=0, per_channel=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, hk, dk, generator=g)
    k = torch.randn(length, hk, dk, generator=g)
    v = torch.randn(length, hv, dv, generator=g)
    decay = -torch.rand(length, hv, *((dk,) if per_channel else ()), generator=g) * 2  # log decay <= 0
    beta = torch.rand(length, hv, generator=g)
    init = torch.randn(hv, dk, dv, generator=g)
    return q, k, v, decay, beta, init


def _naive(q, k, v, decay, beta, init, l2_norm_qk):
    """Token by token, head by head, written from the definition."""
    length, hk, dk = k.shape
    hv = v.shape[1]
    state = init.clone()
    out = torch.zeros(length, hv, v.shape[2])
    for t in range(length):
        for h in range(hv):
            qt, kt = q[t, h // (hv // hk)], k[t, h // (hv // hk)]
            if l2_norm_qk:
                qt, kt = qt / torch.sqrt(qt.dot(qt) + 1e-6), kt / torch.sqrt(kt.dot(kt) + 1e-6)
            s = state[h] * torch.exp(decay[t, h]).reshape(-1, 1)  # per head, or per key channel
            s = s + torch.outer(kt, beta[t, h] * (v[t, h] - kt @ s))
            state[h] = s
            out[t, h] = (qt * dk**-0.5) @ s
    return out, state


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (16, 8), (23, 64)])
@pytest.mark.parametrize("l2_norm_qk", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
def test_chunk_and_steps_match_the_recurrence(length, chunk, l2_norm_qk, per_channel):
    q, k, v, decay, beta, init = _inputs(length, per_channel=per_channel)
    o_ref, final_ref = _naive(q, k, v, decay, beta, init, l2_norm_qk)
    o, final = gd.gated_delta_chunk(q, k, v, decay, beta, init, chunk, l2_norm_qk)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)
    pool, slot = torch.zeros(3, *init.shape), torch.tensor([1])
    pool[1] = init
    steps = [
        gd.gated_delta_state_update(pool, slot, q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1], l2_norm_qk)
        for t in range(length)
    ]
    torch.testing.assert_close(torch.cat(steps), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[1], final_ref, rtol=1e-4, atol=1e-4)
    assert not pool[0].any() and not pool[2].any()


@pytest.mark.parametrize("per_channel", [False, True])
def test_chunk_split_equals_whole(per_channel):
    q, k, v, decay, beta, init = _inputs(40, per_channel=per_channel)
    o, final = gd.gated_delta_chunk(q, k, v, decay, beta, init, 8)
    o1, mid = gd.gated_delta_chunk(q[:13], k[:13], v[:13], decay[:13], beta[:13], init, 8)
    o2, final2 = gd.gated_delta_chunk(q[13:], k[13:], v[13:], decay[13:], beta[13:], mid, 8)
    torch.testing.assert_close(torch.cat([o1, o2]), o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final2, final, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("per_channel", [False, True])
def test_varlen_equals_each_sequence_and_updates_the_pool_by_slot(per_channel):
    lens = [5, 1, 12]
    parts = [_inputs(n, seed=i, per_channel=per_channel) for i, n in enumerate(lens)]
    cat = [torch.cat([p[i] for p in parts]) for i in range(5)]
    slots = torch.tensor([3, 0, 2])
    pool = torch.zeros(4, *parts[0][5].shape)
    for slot, p in zip(slots, parts):
        pool[slot] = p[5]
    o = gd.gated_delta_varlen(*cat, lens, pool, slots, 4, True)
    for i, p in enumerate(parts):
        o_ref, f_ref = _naive(*p, True)
        a = sum(lens[:i])
        torch.testing.assert_close(o[a : a + lens[i]], o_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slots[i]], f_ref, rtol=1e-4, atol=1e-4)
    assert not pool[1].any()


def test_state_update_keeps_the_pool_dtype():
    q, k, v, decay, beta, init = _inputs(3)
    pool = init[None].repeat(3, 1, 1, 1).to(torch.bfloat16)
    before = pool.clone()
    gd.gated_delta_state_update(pool, torch.arange(3), q, k, v, decay, beta)
    assert pool.dtype == torch.bfloat16 and not torch.equal(pool, before)


@pytest.mark.parametrize("length", [9, 70])
def test_matches_transformers_torch_functions(length):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, decay, beta, init = _inputs(length, hk=2, hv=4, dk=8, dv=6)
    o, final = gd.gated_delta_chunk(q, k, v, decay, beta, init, 64, True)
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        o_ref, final_ref = fn(
            q[None], k[None], v[None], decay[None], beta[None], initial_state=init[None], output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        torch.testing.assert_close(o, o_ref[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final, final_ref[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("length", [9, 70])
def test_per_channel_decay_matches_transformers_kimi_functions(length):
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, decay, beta, init = _inputs(length, hk=3, hv=3, dk=8, dv=8, per_channel=True)
    o, final = gd.gated_delta_chunk(q, k, v, decay, beta, init, 64, True)
    for fn in (hf.chunk_kimi_delta_attention, hf.recurrent_kimi_delta_attention):
        o_ref, final_ref = fn(
            q[None], k[None], v[None], decay[None], beta[None], initial_state=init[None], output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        torch.testing.assert_close(o, o_ref[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final, final_ref[0], rtol=1e-4, atol=1e-4)


def test_strong_per_channel_decay_over_a_long_chunk_stays_finite():
    """exp(-c) of a 64-step cumulative decay of -30 a step overflows float32; the pairwise decays do not."""
    q, k, v, decay, beta, init = _inputs(64, hk=1, hv=1, dk=4, dv=3, per_channel=True)
    decay[:, :, 0] = -30.0
    o, final = gd.gated_delta_chunk(q, k, v, decay, beta, init, 64)
    o_ref, final_ref = _naive(q, k, v, decay, beta, init, False)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)
