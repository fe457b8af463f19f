"""Each op against a reference written differently (the recurrence by definition, dense math)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engram.ops import activation, attention, conv, moe, norm, rotary, ssd


def _ssd_inputs(length: int, heads=4, head_dim=3, groups=2, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, heads, head_dim, generator=g)
    dt = F.softplus(torch.randn(length, heads, generator=g))
    A = -torch.rand(heads, generator=g) * 4
    B = torch.randn(length, groups, n, generator=g)
    C = torch.randn(length, groups, n, generator=g)
    D = torch.randn(heads, generator=g)
    init = torch.randn(heads, head_dim, n, generator=g)
    return x, dt, A, B, C, D, init


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (8, 4), (33, 8), (50, 16)])
def test_chunk_scan_matches_recurrence(length, chunk):
    x, dt, A, B, C, D, init = _ssd_inputs(length)
    y, final = ssd.ssd_chunk_scan(x, dt, A, B, C, D, chunk, init)
    y_ref, final_ref = ssd.ssd_sequential(x, dt, A, B, C, D, init)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, final_ref, atol=1e-4, rtol=1e-4)


def test_chunk_scan_split_equals_whole():
    x, dt, A, B, C, D, init = _ssd_inputs(40)
    y, final = ssd.ssd_chunk_scan(x, dt, A, B, C, D, 8, init)
    y1, mid = ssd.ssd_chunk_scan(x[:13], dt[:13], A, B[:13], C[:13], D, 8, init)
    y2, final2 = ssd.ssd_chunk_scan(x[13:], dt[13:], A, B[13:], C[13:], D, 8, mid)
    torch.testing.assert_close(torch.cat([y1, y2]), y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final2, final, atol=1e-4, rtol=1e-4)


def test_varlen_scan_equals_each_sequence_and_updates_the_pool_by_slot():
    lens = [5, 1, 17]
    parts = [_ssd_inputs(n, seed=i) for i, n in enumerate(lens)]
    g = torch.Generator().manual_seed(9)
    heads = parts[0][0].shape[1]
    dt_raw = [torch.randn(n, heads, generator=g) for n in lens]
    dt_bias, A_log, D = torch.randn(heads, generator=g), torch.randn(heads, generator=g), parts[0][5]
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    slots = torch.tensor([3, 0, 2])
    pool = torch.randn(4, *parts[0][6].shape, generator=g)
    for i, p in enumerate(parts):
        pool[slots[i]] = p[6]
    untouched = pool[1].clone()
    inits = pool.clone()
    y = ssd.ssd_varlen(cat(0), torch.cat(dt_raw), dt_bias, (0.0, float("inf")), A_log, cat(3), cat(4), D, 4, lens, pool, slots)
    for i, p in enumerate(parts):
        dt, A = ssd.discretize(dt_raw[i], dt_bias, (0.0, float("inf")), A_log)
        y_ref, f_ref = ssd.ssd_sequential(p[0], dt, A, p[3], p[4], D, inits[slots[i]])
        start = sum(lens[:i])
        torch.testing.assert_close(y[start : start + lens[i]], y_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool[slots[i]], f_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool[1], untouched, atol=0, rtol=0)


def test_state_update_by_slot_equals_step():
    x, dt, A, B, C, D, init = _ssd_inputs(2)
    g = torch.Generator().manual_seed(4)
    dt_raw, dt_bias, A_log = torch.randn(2, 4, generator=g), torch.randn(4, generator=g), torch.randn(4, generator=g)
    pool = torch.randn(3, *init.shape, generator=g)
    before = pool.clone()
    slots = torch.tensor([2, 0])
    y = ssd.ssd_state_update(pool, slots, x, dt_raw, dt_bias, (0.0, 0.5), A_log, B, C, D)
    dt_d, A_d = ssd.discretize(dt_raw, dt_bias, (0.0, 0.5), A_log)
    assert float(dt_d.max()) <= 0.5
    y_ref, new = ssd.ssd_step(before[slots], x, dt_d, A_d, B, C, D)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(pool[slots], new)
    torch.testing.assert_close(pool[1], before[1], atol=0, rtol=0)


def test_causal_conv_with_state_equals_step_by_step():
    g = torch.Generator().manual_seed(0)
    channels, k, length = 6, 4, 9
    x = torch.randn(length, channels, generator=g)
    w, b = torch.randn(channels, k, generator=g), torch.randn(channels, generator=g)
    state0 = torch.randn(k - 1, channels, generator=g)
    y, state = conv.causal_conv1d(x, w, b, state0)
    pool = torch.randn(3, k - 1, channels, generator=g)
    pool[1] = state0
    slot = torch.tensor([1])
    for t in range(length):
        yt = conv.causal_conv1d_update(x[t : t + 1], w, b, pool, slot)
        torch.testing.assert_close(yt[0], y[t], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[1], state)
    # the varlen op over the pool: same outputs, same final state
    pool2 = torch.randn(3, k - 1, channels, generator=g)
    pool2[2] = state0
    yv = conv.causal_conv1d_varlen(x, w, b, pool2, torch.tensor([2]), [length])
    torch.testing.assert_close(yv, y)
    torch.testing.assert_close(pool2[2], state)
    # zero state == zero padding (the convolution of a fresh sequence)
    y0, _ = conv.causal_conv1d(x, w, b, torch.zeros(k - 1, channels))
    dense = F.conv1d(x.t()[None], w[:, None], b, padding=k - 1, groups=channels)[0, :, :length].t()
    torch.testing.assert_close(y0, F.silu(dense))


def test_paged_attention_matches_dense_causal_attention():
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 6, 2, 8, 4
    ctx, n = [0, 5, 3], [7, 1, 4]
    k_cache = torch.zeros(64, hkv, d)
    v_cache = torch.zeros(64, hkv, d)
    tables = torch.tensor([[3, 0, 9, -1], [1, 2, -1, -1], [4, 5, -1, -1]])
    keys, values, qs = [], [], []
    for i in range(3):
        total = ctx[i] + n[i]
        kk, vv = torch.randn(total, hkv, d, generator=g), torch.randn(total, hkv, d, generator=g)
        attention.store_kv(k_cache, v_cache, kk, vv, attention.token_slots(tables[i], total, bs))
        keys.append(kk), values.append(vv), qs.append(torch.randn(n[i], hq, d, generator=g))
    out = attention.paged_attention(torch.cat(qs), k_cache, v_cache, n, ctx, tables, bs, 0.3)
    start = 0
    for i in range(3):
        q = qs[i].transpose(0, 1)
        k = keys[i].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        v = values[i].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        mask = torch.ones(n[i], ctx[i] + n[i], dtype=torch.bool).tril(diagonal=ctx[i])
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n[i]], ref, atol=1e-5, rtol=1e-5)
        start += n[i]


def test_gated_rms_norm_groups():
    g = torch.Generator().manual_seed(0)
    x, z, w = torch.randn(3, 12, generator=g), torch.randn(3, 12, generator=g), torch.randn(12, generator=g)
    out = norm.gated_rms_norm(x, z, w, 1e-6, 4)
    h = (x * F.silu(z)).view(3, 3, 4)
    ref = (h / h.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).view(3, 12) * w
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_falcon_h1_output_norms_match_transformers(norm_before_gate):
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

    g = torch.Generator().manual_seed(1)
    y, z = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g)
    ref = FalconH1RMSNormGated(12, eps=1e-5, n_groups=3, norm_before_gate=norm_before_gate)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(12, generator=g) + 0.5)
        expected = ref(y[:, None], z[:, None])[:, 0]
    op = norm.norm_then_gate if norm_before_gate else norm.gated_rms_norm
    torch.testing.assert_close(op(y, z, ref.weight.detach(), 1e-5, 4, torch.float32), expected)
    torch.testing.assert_close(activation.silu_gate(y, z, torch.bfloat16), (y * F.silu(z)).to(torch.bfloat16))


def test_rotary_partial_matches_transformers():
    from transformers.models.bamba.modeling_bamba import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    cos, sin = rotary.rotary_cos_sin(torch.arange(3, 8), 4, 10000.0, torch.float32)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(rotary.apply_rotary(q, cos, sin), q_ref[0].transpose(0, 1))
    torch.testing.assert_close(rotary.apply_rotary(k, cos, sin), k_ref[0].transpose(0, 1))


def test_moe_experts_equals_dense_mixture():
    g = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts = 6, 8, 5, 4
    x = torch.randn(tokens, hidden, generator=g)
    w_in, w_out = torch.randn(experts, 2 * inter, hidden, generator=g), torch.randn(experts, hidden, inter, generator=g)
    weights, ids = moe.route_softmax_topk(torch.randn(tokens, experts, generator=g), 2)
    out = moe.moe_experts(x, w_in, w_out, weights, ids, F.silu, True)
    ref = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(2):
            gate, up = (w_in[ids[t, j]] @ x[t]).chunk(2)
            ref[t] += weights[t, j] * (w_out[ids[t, j]] @ (F.silu(gate) * up))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sigmoid_grouped_routing_respects_groups():
    logits = torch.tensor([[5.0, 4.0, -5.0, -4.0, 0.0, 0.1, 0.2, 0.3]])
    weights, ids = moe.route_sigmoid_grouped(logits, torch.zeros(8), top_k=2, n_group=4, topk_group=1, norm_topk_prob=True, routed_scaling=2.0)
    assert sorted(ids[0].tolist()) == [0, 1]
    torch.testing.assert_close(weights.sum(), torch.tensor(2.0))
