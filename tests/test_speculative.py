"""Speculative decoding (engine/speculative.py): output with speculation equals output without it,
token for token, whatever the drafts; a rejected draft leaves no trace in the recurrent state; sampled
output keeps the target distribution; max_tokens, stop tokens and grammars hold; metrics count."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from engine_utils import ReferenceDrafter, greedy, launch_counts, make_engine, run_to_end
from scipy.stats import chisquare

from engram.engine import speculative
from engram.engine.drafter import NgramDrafter
from engram.engine.request import FinishReason, SamplingParams, StructuredOutputsParams
from engram.engine.spec_config import SpeculativeConfig
from engram.models.spec import LayerKind
from engram.ops import verify
from engram.ops.dispatch import kernels, use_kernels

# every architecture: Mamba2 (alone, beside attention, side by side with it), gated DeltaNet, short conv
ARCHS = ["mamba2", "granite", "nemotron", "bamba", "falcon_h1", "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2"]
K = 3
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
# mixed lengths, some repeating (prompt lookup finds drafts), one longer than a mamba chunk
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12] * 7, list(range(20, 60)), [3, 4]]


def generate(engine, prompts, params, drafter=None) -> list[list[int]]:
    if drafter is not None:
        engine.speculator.drafter = drafter
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params if isinstance(params, SamplingParams) else params(i))
    out = run_to_end(engine)
    return [out[f"r{i}"].token_ids for i in range(len(prompts))]


def spec_counts(engine) -> tuple[int, int]:
    s = engine.stats()
    return s.spec_draft_tokens_total, s.spec_accepted_tokens_total


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_speculation_equals_greedy_without(arch, checkpoint_dir, hf_model):
    path = checkpoint_dir(arch)
    plain = generate(make_engine(path), PROMPTS, greedy(20))
    engine = make_engine(path, speculative_config=NGRAM)

    assert generate(engine, PROMPTS, greedy(20)) == plain
    drafted, _ = spec_counts(engine)
    assert drafted > 0  # prompt lookup found drafts in the repeating prompts (a random model's output rarely repeats: few kept)

    ref = hf_model(path)
    before = spec_counts(engine)
    assert generate(engine, PROMPTS, greedy(20), ReferenceDrafter(ref)) == plain
    drafted, accepted = (a - b for a, b in zip(spec_counts(engine), before))
    assert drafted > 0 and accepted == drafted  # forced right: every draft kept
    steps_right = engine.stats()

    before = spec_counts(engine)
    assert generate(engine, PROMPTS, greedy(20), ReferenceDrafter(ref, wrong=True)) == plain
    drafted, accepted = (a - b for a, b in zip(spec_counts(engine), before))
    assert drafted > 0 and accepted == 0  # forced wrong: every draft rejected, and still exact
    assert steps_right.spec_accepted_per_position[K - 1] > 0

    before = spec_counts(engine)
    assert generate(engine, PROMPTS, greedy(20), ReferenceDrafter(ref, mixed=True)) == plain
    drafted, accepted = (a - b for a, b in zip(spec_counts(engine), before))
    assert 0 < accepted < drafted  # kept in part: the state rolled back past a kept token
    done = engine.stats()
    assert done.kv_blocks_used == 0 and done.state_slots_used == 0  # the draft's pages went back


def test_speculation_under_kv_pressure_equals_plain(checkpoint_dir, hf_model):
    """Few KV pages: sequences are preempted and recomputed, drafts get only free pages; still exact."""
    path = checkpoint_dir("nemotron")
    prompts = [list(range(10 + i, 40 + i)) for i in range(4)]
    small = dict(max_total_tokens=160, kv_block_size=8, context_length=80)
    plain_engine = make_engine(path, **small)
    plain = generate(plain_engine, prompts, greedy(40))
    engine = make_engine(path, speculative_config=NGRAM, **small)
    assert generate(engine, prompts, greedy(40), ReferenceDrafter(hf_model(path), wrong=True)) == plain
    assert engine.stats().num_preemptions > 0 and engine.stats().spec_draft_tokens_total > 0
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize(
    ("arch", "op"), [("granite", "commit_states"), ("qwen3_next", "commit_states"), ("qwen3_next", "commit_windows"), ("lfm2", "commit_windows")]
)
def test_a_broken_rollback_is_caught(arch, op, checkpoint_dir, hf_model):
    """Committing a state tensor after one token more than was kept (the first rejected draft
    included) changes the output: the test above would fail, for each kind of state buffer."""
    path = checkpoint_dir(arch)
    plain = generate(make_engine(path), PROMPTS, greedy(20))
    engine = make_engine(path, speculative_config=NGRAM)
    correct = kernels()
    commit = getattr(correct, op)

    def one_too_many(pool, slots, buffer, rows, fed):
        positions = buffer.shape[1] - (pool.shape[1] if op == "commit_windows" else 0)  # a window's first K-1 rows are the old state
        commit(pool, slots, buffer, rows, (fed + 1).clamp_max(positions))

    use_kernels(dataclasses.replace(correct, **{op: one_too_many}))
    try:
        assert generate(engine, PROMPTS, greedy(20), ReferenceDrafter(hf_model(path), wrong=True)) != plain
    finally:
        use_kernels(correct)


def test_max_tokens_and_stop_tokens_hold(checkpoint_dir, hf_model):
    path = checkpoint_dir("nemotron")
    ref = hf_model(path)
    engine = make_engine(path, speculative_config=NGRAM)
    for n in (1, 2, 3, 5):  # never more tokens than asked, though a step could keep K + 1
        out = generate(engine, PROMPTS, greedy(n), ReferenceDrafter(ref))
        assert [len(t) for t in out] == [n] * len(PROMPTS)
    lps = []
    for e in (make_engine(path), engine):  # each token's logprobs come from its own row
        e.add_request("lp", PROMPTS[2], greedy(9, logprobs=2))
        lps.append([lp for _ in iter(e.has_unfinished_requests, False) for out in e.step() for lp in out.logprobs])
    plain_lp, spec_lp = lps
    assert len(spec_lp) == 9 and [lp.token_id for lp in spec_lp] == [lp.token_id for lp in plain_lp]
    assert all(abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top] for a, b in zip(spec_lp, plain_lp))
    full = generate(make_engine(path), PROMPTS[:1], greedy(12))[0]
    stop = full[6]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop])
    engine.speculator.drafter = ReferenceDrafter(ref)
    engine.add_request("s", PROMPTS[0], params)
    out = run_to_end(engine)["s"]
    assert out.token_ids == full[: full.index(stop) + 1] and out.finish_reason == FinishReason.STOP


@pytest.mark.parametrize("arch", ["bamba", "qwen3_next", "lfm2"])
def test_a_speculative_turn_snapshot_resumes_exactly(arch, checkpoint_dir, hf_model):
    """The state captured after a speculative turn is the committed one: continuing from it (in an engine
    without speculation) equals a full prefill of the whole history."""
    path = checkpoint_dir(arch)
    engine = make_engine(path, speculative_config=NGRAM)
    engine.speculator.drafter = ReferenceDrafter(hf_model(path), wrong=True)
    engine.add_request("t1", PROMPTS[1], greedy(9), capture_state=True)
    first = run_to_end(engine)["t1"]
    assert engine.stats().spec_draft_tokens_total > 0
    history = PROMPTS[1] + first.token_ids
    assert first.state.tokens == history and first.state.state_len == len(history) - 1
    new = [7, 8, 9]
    resumed = make_engine(path)
    resumed.add_request("t2", history + new, greedy(8), initial_state=first.state)
    prefilled = make_engine(path)
    prefilled.add_request("t2", history + new, greedy(8))
    assert run_to_end(resumed)["t2"].token_ids == run_to_end(prefilled)["t2"].token_ids


def test_seeded_sampling_is_the_same_with_speculation(checkpoint_dir, hf_model):
    """Each kept token is a draw of the request's own generator from the target distribution, one
    draw per token as without speculation: seeded outputs agree token for token."""
    path = checkpoint_dir("granite")

    def params(i):
        return SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True, frequency_penalty=0.3)

    plain = generate(make_engine(path), PROMPTS, params)
    engine = make_engine(path, speculative_config=NGRAM)
    assert generate(engine, PROMPTS, params, ReferenceDrafter(hf_model(path))) == plain
    drafted, accepted = spec_counts(engine)
    assert 0 < accepted < drafted  # some drafts kept, some rejected


def test_sampled_distribution_matches_the_target(checkpoint_dir, hf_model):
    """Unseeded sampling (the engine's generator, drawn in another order than without speculation):
    the empirical distribution of the second and third tokens, whose rows verify drafts, against the
    target's exact one from transformers (top-k 3: 27 outcomes), by a chi-square test."""
    path = checkpoint_dir("mamba2")
    ref = hf_model(path)
    prompt, n = [5, 6, 7, 8, 9, 5, 6], 1200
    engine = make_engine(path, speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 2}), max_running_requests=16, seed=3)
    engine.speculator.drafter = ReferenceDrafter(ref)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    outs = generate(engine, [prompt] * n, params)
    drafted, accepted = spec_counts(engine)
    assert 0 < accepted < drafted

    def top3(tokens):
        with torch.no_grad():
            logits = ref(torch.tensor([tokens])).logits[0, -1]
        top = torch.topk(logits, 3)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    expected = {}
    for t1, p1 in top3(prompt).items():
        for t2, p2 in top3(prompt + [t1]).items():
            for t3, p3 in top3(prompt + [t1, t2]).items():
                expected[(t1, t2, t3)] = p1 * p2 * p3
    seen = [tuple(o) for o in outs]
    assert set(seen) <= set(expected)
    cells = [c for c in expected if expected[c] * n >= 5]
    rest = n - sum(expected[c] * n for c in cells)
    observed = [seen.count(c) for c in cells] + [n - sum(seen.count(c) for c in cells)]
    _, p = chisquare(observed, [expected[c] * n for c in cells] + [rest])
    assert p > 1e-3, (observed, p)


def test_a_draft_the_grammar_refuses_is_rejected(checkpoint_dir, hf_model):
    path = checkpoint_dir("mamba2")
    regex = r"[a-c]{3,6}-[0-9]{2}"

    def params(i):
        return SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=regex))

    prompts = [list(b"say abc-12 "), list(b"abab")]
    plain_engine = make_engine(path)
    plain = generate(plain_engine, prompts, params)
    engine = make_engine(path, speculative_config=NGRAM)
    # drafts of the target's unconstrained continuation: the grammar refuses most of them
    assert generate(engine, prompts, params, ReferenceDrafter(hf_model(path))) == plain
    drafted, accepted = spec_counts(engine)
    assert drafted > 0 and accepted < drafted


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NgramDrafter(min_n=1, max_n=3)
    assert d.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert d.propose([1, 2, 9, 1, 2, 7, 1, 2], 2) == [7, 1]  # the latest occurrence of [1, 2]
    assert d.propose([5, 6, 7], 2) == []
    assert NgramDrafter(min_n=2, max_n=2).propose([1, 2, 3, 1], 2) == []  # a 1-gram match is too short


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("{", "not JSON"),
        ('{"method": "mtp", "num_speculative_tokens": 1}', "MTP layers"),
        ('{"method": "eagle", "num_speculative_tokens": 1}', "method must be one of"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', "unknown field"),
    ],
)
def test_a_bad_speculative_config_names_the_field(raw, says):
    with pytest.raises(ValueError, match=says):
        SpeculativeConfig.parse(raw)


@pytest.mark.parametrize(
    "arch, kind",
    [("qwen3_next", LayerKind.GATED_DELTANET), ("lfm2", LayerKind.SHORT_CONV), ("granite", LayerKind.MAMBA), ("kimi_linear", LayerKind.KDA)],
)
def test_a_model_without_verify_states_refuses_speculation_by_name(arch, kind, checkpoint_dir, monkeypatch):
    """A kind that keeps state but is not declared verified (`VERIFIED_KINDS`) would write every
    drafted token into the recurrent state: refused at start-up, by its name."""
    monkeypatch.setattr(speculative, "VERIFIED_KINDS", speculative.VERIFIED_KINDS - {kind})
    with pytest.raises(ValueError, match=f"--speculative-config: .*the {kind.value} layers of"):
        make_engine(checkpoint_dir(arch), speculative_config=NGRAM)


def test_speculative_config_defaults_follow_vllm():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)


@pytest.mark.parametrize("arch", ["bamba", "qwen3_next", "lfm2"])
def test_the_memory_plan_reserves_a_full_verify_step(arch, checkpoint_dir):
    path = checkpoint_dir(arch)
    plain, spec = make_engine(path), make_engine(path, speculative_config=NGRAM)
    reserved = spec.plan.scratch_bytes - plain.plan.scratch_bytes
    buffers = spec.speculator._buffers(spec.args.max_running_requests, K + 1)
    assert len(buffers.windows) + len(buffers.states) == len(spec.state_pool.tensors)  # every state tensor has its buffer
    used = sum(t.numel() * t.element_size() for t in (*buffers.windows.values(), *buffers.states.values()))
    logits = spec.args.max_running_requests * K * spec.spec.vocab_size * 4  # the k more rows each sequence samples from
    assert reserved >= used + logits


def test_verify_ops_keep_the_state_after_every_position():
    """ops/verify.py against the definitions: the conv state and SSM state after f tokens of each
    sequence are those of `causal_conv1d` and `ssd_sequential` over its first f tokens, and the pool is
    written only by the commit, with each sequence's own f."""
    from engram.ops.conv import causal_conv1d
    from engram.ops.ssd import discretize, ssd_sequential

    g = torch.Generator().manual_seed(0)
    heads, head_dim, groups, n, chans, k1 = 4, 3, 2, 5, 7, 3
    lens = [3, 1, 4]
    slots = torch.tensor([2, 0, 3])
    total = sum(lens)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    x, dt, B, C = rand(total, heads, head_dim), rand(total, heads), rand(total, groups, n), rand(total, groups, n)
    dt_bias, A_log, D = rand(heads), rand(heads), rand(heads)
    xc, weight, bias = rand(total, chans), rand(chans, k1 + 1), rand(chans)
    conv_pool, ssm_pool = rand(4, k1, chans), rand(4, heads, head_dim, n)
    conv_before, ssm_before = conv_pool.clone(), ssm_pool.clone()
    windows, states = torch.empty(3, k1 + max(lens), chans), torch.empty(3, max(lens), heads, head_dim, n)

    rows, flat = verify.verify_layout(lens, torch.device("cpu"))
    yc = verify.causal_conv1d_verify(xc, weight, bias, conv_pool, slots, rows, flat, windows)
    y = verify.ssd_verify(x, dt, dt_bias, (0.0, float("inf")), A_log, B, C, D, rows, flat, ssm_pool, slots, states)
    assert torch.equal(conv_pool, conv_before) and torch.equal(ssm_pool, ssm_before)

    dtd, A = discretize(dt, dt_bias, (0.0, float("inf")), A_log)
    fed = torch.tensor([2, 1, 4])
    start = 0
    for i, length in enumerate(lens):
        rows = slice(start, start + length)
        ref_y, _ = causal_conv1d(xc[rows], weight, bias, conv_before[slots[i]])
        torch.testing.assert_close(yc[rows], ref_y)
        ref_ssm_y, _ = ssd_sequential(x[rows], dtd[rows], A, B[rows], C[rows], D, ssm_before[slots[i]])
        torch.testing.assert_close(y[rows], ref_ssm_y)
        start += length
    verify.commit_windows(conv_pool, slots, windows, torch.arange(3), fed)
    verify.commit_states(ssm_pool, slots, states, torch.arange(3), fed)
    start = 0
    for i, f in enumerate(fed.tolist()):
        rows = slice(start, start + f)
        _, conv_ref = causal_conv1d(xc[rows], weight, bias, conv_before[slots[i]])
        _, ssm_ref = ssd_sequential(x[rows], dtd[rows], A, B[rows], C[rows], D, ssm_before[slots[i]])
        torch.testing.assert_close(conv_pool[slots[i]], conv_ref)
        torch.testing.assert_close(ssm_pool[slots[i]], ssm_ref)
        start += lens[i]
    assert torch.equal(conv_pool[1], conv_before[1]) and torch.equal(ssm_pool[1], ssm_before[1])  # no row of this step


def test_gated_delta_and_short_conv_verify_keep_the_state_after_every_position():
    """ops/verify.py's gated delta rule against its chunked form (`gated_delta_chunk`, the prefill's
    algorithm): o, and the state after each of f tokens of every sequence is the chunked form's
    final state over its first f tokens; the short conv's window (no SiLU) against `causal_conv1d`;
    the pool is written only by the commits, with each sequence's own f."""
    from engram.ops.conv import causal_conv1d
    from engram.ops.gated_delta import gated_delta_chunk

    g = torch.Generator().manual_seed(1)
    hk, hv, dk, dv, chans, k1 = 2, 4, 5, 3, 6, 2
    lens, slots = [3, 1, 4], torch.tensor([2, 0, 3])
    total = sum(lens)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    q, k, v = rand(total, hk, dk), rand(total, hk, dk), rand(total, hv, dv)
    decay, beta = -torch.rand(total, hv, generator=g), torch.rand(total, hv, generator=g)
    x, weight = rand(total, chans), rand(chans, k1 + 1)
    pool, conv_pool = rand(4, hv, dk, dv), rand(4, k1, chans)
    before, conv_before = pool.clone(), conv_pool.clone()
    states, windows = torch.empty(3, max(lens), hv, dk, dv), torch.empty(3, k1 + max(lens), chans)

    rows, flat = verify.verify_layout(lens, torch.device("cpu"))
    o = verify.gated_delta_verify(q, k, v, decay, beta, rows, flat, pool, slots, states, True)
    y = verify.causal_conv1d_verify(x, weight, None, conv_pool, slots, rows, flat, windows, silu=False)
    assert torch.equal(pool, before) and torch.equal(conv_pool, conv_before)
    fed = torch.tensor([2, 1, 4])
    verify.commit_states(pool, slots, states, torch.arange(3), fed)
    verify.commit_windows(conv_pool, slots, windows, torch.arange(3), fed)
    start = 0
    for i, length in enumerate(lens):
        seq = slice(start, start + length)
        ref_o, _ = gated_delta_chunk(q[seq], k[seq], v[seq], decay[seq], beta[seq], before[slots[i]], 4, True)
        torch.testing.assert_close(o[seq], ref_o)
        ref_y, _ = causal_conv1d(x[seq], weight, None, conv_before[slots[i]], silu=False)
        torch.testing.assert_close(y[seq], ref_y)
        for f in range(1, length + 1):
            kept = slice(start, start + f)
            _, ref_state = gated_delta_chunk(q[kept], k[kept], v[kept], decay[kept], beta[kept], before[slots[i]], 4, True)
            torch.testing.assert_close(states[i, f - 1], ref_state)
        kept = slice(start, start + int(fed[i]))
        _, ref_state = gated_delta_chunk(q[kept], k[kept], v[kept], decay[kept], beta[kept], before[slots[i]], 4, True)
        _, ref_window = causal_conv1d(x[kept], weight, None, conv_before[slots[i]], silu=False)
        torch.testing.assert_close(pool[slots[i]], ref_state)
        torch.testing.assert_close(conv_pool[slots[i]], ref_window)
        start += length
    assert torch.equal(pool[1], before[1]) and torch.equal(conv_pool[1], conv_before[1])  # no row of this step


class _Repeat:
    """k drafted tokens, always: verify steps of a known width."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return token_ids[-1:] * min(self.k, k)


def _forward_ops(engine, width: int) -> int:
    """The aten ops (views left out) of the forward of the step after a prefill and a decode step,
    which feeds `width` tokens."""
    engine.add_request("ops", list(range(3, 30)), greedy(16))
    for _ in range(2):
        engine.step()
    run = engine.runner.run

    def marked(chunks, *args):
        assert [c.length for c in chunks] == [width]
        with torch.profiler.record_function("forward"):
            return run(chunks, *args)

    engine.runner.run = marked
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
    engine.runner.run = run
    engine.abort_request("ops")
    run_to_end(engine)
    return launch_counts(prof.events(), "forward")["aten_ops"]


def test_a_verify_forward_takes_the_ops_of_a_decode_forward(checkpoint_dir):
    """Mamba2 layers only (the references of attention and MoE loop over sequences and experts): the
    verify ops compute every position at once but for the SSD state's recurrence (two ops a position
    and layer), so a verify forward of k = 4 takes the ops of an eager decode forward (it took 2.8x)."""
    path = checkpoint_dir("mamba2")
    decode = _forward_ops(make_engine(path), 1)
    engine = make_engine(path, speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 4}))
    verify = {}
    for k in (1, 4):
        engine.speculator.drafter = _Repeat(k)
        verify[k] = _forward_ops(engine, k + 1)
    layers = len(engine.spec.mamba_layers)
    assert verify[4] - verify[1] <= 2 * 3 * layers
    assert verify[4] <= 1.05 * decode


def test_engram_plan_takes_the_speculative_config(capsys):
    """`engram plan` reserves what the engine reserves (Granite-4.0-H-tiny's shape, batch 8, k 4)."""
    from pathlib import Path

    from engram.engine.memory_planner import state_dtypes, verify_bytes
    from engram.models.spec import load_model_spec
    from engram.plan import main as plan_main

    config = Path(__file__).parent / "data" / "configs" / "granite-4.0-h-tiny.json"
    base = ["--model-path", str(config), "--max-running-requests", "8", "--json"]
    plan_main(base)
    plain = json.loads(capsys.readouterr().out)
    plan_main([*base, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    spec = json.loads(capsys.readouterr().out)
    model = load_model_spec(config)
    reserve = verify_bytes(model, state_dtypes(model, torch.bfloat16, "float32", "auto"), 8, 4)
    assert spec["scratch_bytes"] - plain["scratch_bytes"] == reserve > 2 << 30
    assert plan_main([*base, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']) == 2
    assert "MTP layers" in capsys.readouterr().err
