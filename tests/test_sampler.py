"""The batched sampler: filters row by row, draws from the filtered distribution, no row affects another."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engram.engine.request import SamplingParams
from engram.engine.sampler import adjust_logits, filter_logits, sample_batch, sample_on_device, token_counts, token_mask

MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.1, top_k=7, top_p=0.8, min_p=0.05),
]


def _logits(rows: int, vocab: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_each_row_is_filtered_as_if_alone():
    logits = _logits(len(MIXED))
    together = filter_logits(logits, MIXED)
    for i, p in enumerate(MIXED):
        torch.testing.assert_close(together[i], filter_logits(logits[i : i + 1], [p])[0])


def test_filters_keep_what_they_promise():
    logits = _logits(1, seed=1)
    z = logits[0]
    kept = lambda p: torch.isfinite(filter_logits(logits, [p])[0])  # noqa: E731
    assert set(kept(SamplingParams(top_k=3)).nonzero().flatten().tolist()) == set(z.topk(3).indices.tolist())
    assert kept(SamplingParams(top_p=1e-6)).nonzero().flatten().tolist() == [int(z.argmax())]
    assert kept(SamplingParams(min_p=1.0)).nonzero().flatten().tolist() == [int(z.argmax())]
    probs = torch.softmax(z, dim=-1)
    top_p = kept(SamplingParams(top_p=0.5))
    assert probs[top_p].sum() >= 0.5 and probs[top_p].sum() - probs[top_p].min() < 0.5  # the smallest set reaching 0.5
    assert bool(kept(SamplingParams()).all()) and bool(kept(SamplingParams(top_k=100)).all())  # k beyond the vocabulary


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_the_filtered_distribution_and_greedy_rows_take_the_argmax(device):
    n = 40_000
    logits = _logits(1, vocab=12, seed=2).to(device)
    p = SamplingParams(temperature=0.8, top_k=8, top_p=0.9)
    expected = torch.softmax(filter_logits(logits, [p])[0], dim=-1)
    rows = logits.expand(n + 1, -1).contiguous()
    params = [p] * n + [SamplingParams(temperature=0.0)]
    tokens = sample_on_device(rows, params, torch.Generator(device).manual_seed(0))
    assert int(tokens[-1]) == int(logits.argmax())
    freq = torch.bincount(tokens[:-1].cpu(), minlength=12).float() / n
    expected = expected.cpu()
    assert bool((freq[expected == 0] == 0).all())
    assert float((freq - expected).abs().max()) < 0.015  # about 6 standard deviations at n = 40,000


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_draws_follow_the_filtered_distribution_and_do_not_depend_on_their_batch(device):
    """A seed of its own: one uniform from the request's CPU generator picks the token by inverse
    CDF, so the draws follow the distribution, and a row draws the same token alone, in any batch
    and on any device."""
    n = 20_000
    logits = _logits(1, vocab=12, seed=2).to(device)
    p = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, seed=0)
    expected = torch.softmax(filter_logits(logits, [p])[0], dim=-1).cpu()

    def draw(rows: torch.Tensor, seeds: list[int]) -> list[int]:
        params = [dataclasses.replace(p, seed=s) for s in seeds]
        generators: list[torch.Generator | None] = [torch.Generator().manual_seed(s) for s in seeds]
        return sample_batch(rows, params, lambda i: (None, None), generators, torch.Generator(device).manual_seed(0))

    tokens = draw(logits.expand(n, -1).contiguous(), list(range(n)))
    freq = torch.bincount(torch.tensor(tokens), minlength=12).float() / n
    assert bool((freq[expected == 0] == 0).all())
    assert float((freq - expected).abs().max()) < 0.02  # about 6 standard deviations at n = 20,000
    others = _logits(5, vocab=12, seed=9).to(device)
    for s in (3, 17):
        alone = draw(logits, [s])[0]
        assert draw(torch.cat([others[:2], logits, others[2:]]), [1, 2, s, 4, 5, 6])[2] == alone
        assert draw(logits.cpu(), [s])[0] == alone


@pytest.mark.parametrize("device", DEVICES)
def test_an_argmax_taken_in_the_decode_graph_is_kept_and_drawn_rows_drawn_over_it(device):
    """`argmax_done`: `out` already holds the greedy rows' tokens (a decode graph's argmax), which are
    kept as they are (not recomputed), while the other rows draw as they would without it."""
    params = [SamplingParams(temperature=0.0), *MIXED, SamplingParams(temperature=0.0)]
    logits = _logits(len(params), seed=6).to(device)
    plain = sample_on_device(logits, params, torch.Generator(device).manual_seed(1))
    out = torch.full((len(params),), 7, dtype=torch.int64, device=device)  # not the argmax of the greedy rows
    got = sample_on_device(logits, params, torch.Generator(device).manual_seed(1), out=out, argmax_done=True)
    assert got is out
    assert got[[0, -1]].tolist() == [7, 7]
    assert torch.equal(got[1:-1], plain[1:-1])
    assert plain[[0, -1]].tolist() == logits[[0, -1]].argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_logits_in_the_model_dtype_are_sampled_as_their_float32_copy(device):
    """The model hands over its logits in its own dtype: every row, drawn on the device or on the
    host's terms (penalties, a seed of its own), picks the token its float32 copy picks."""
    params = MIXED * 8 + [SamplingParams(temperature=0.8, top_p=0.9, seed=i, repetition_penalty=1.3) for i in range(8)]
    logits = _logits(len(params), vocab=4000, seed=5).to(device, torch.bfloat16)

    def draw(x: torch.Tensor) -> list[int]:
        generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        history = lambda i: (token_mask([1, 2], 4000, x.device), token_counts([3, 3], 4000, x.device))  # noqa: E731
        return sample_batch(x, params, history, generators, torch.Generator(device).manual_seed(0))

    assert draw(logits) == draw(logits.float())


def test_tiny_temperature_or_top_p_keeps_the_most_likely_token():
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0]])
    assert SamplingParams(temperature=1e-46).greedy  # would overflow the division by the temperature
    kept = filter_logits(logits, [SamplingParams(top_p=1e-300)])  # 0 in float32
    assert torch.isfinite(kept).tolist() == [[False, True, False, False]]


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": float("nan")},
        {"repetition_penalty": 1e-320},
        {"presence_penalty": -1e308},
        {"frequency_penalty": float("inf")},
        {"temperature": float("nan")},
        {"top_p": float("nan")},
        {"stop": ["", "x"]},
        {"logit_bias": {3: 101.0}},
        {"logit_bias": {3: float("nan")}},
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
    ],
)
def test_values_the_sampler_cannot_use_are_refused(fields):
    with pytest.raises(ValueError, match=next(iter(fields)) if "stop" not in fields else "stop"):
        SamplingParams(**fields)


def test_logit_bias_moves_only_its_rows_tokens():
    logits = _logits(3, seed=4)
    loser, winner = int(logits[1].argmin()), int(logits[1].argmax())
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={loser: 100.0, winner: -100.0}),
        SamplingParams(temperature=0.5, logit_bias={t: -100.0 for t in range(40) if t != 7}),
    ]
    tokens = sample_batch(logits, params, lambda i: (None, None), [None] * 3, torch.Generator().manual_seed(0))
    assert tokens == [int(logits[0].argmax()), loser, 7]
    assert not params[1].has_penalties and params[1].adjusts_logits and not params[0].adjusts_logits


def test_repetition_penalty_scales_each_token_of_the_prompt_or_output_once():
    """vLLM's rule: a seen token's positive logit is divided by the penalty, a negative one multiplied;
    a token seen several times is scaled once; frequency and presence penalties read the output only."""
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = adjust_logits(logits.clone(), params, token_mask([0, 1, 0], 6, logits.device), token_counts([3, 3, 1], 6, logits.device))
    assert torch.equal(out, torch.tensor([1.0, -4.0, 1.0, -2.0, 0.5, 3.0]))
    assert torch.equal(adjust_logits(logits.clone(), params, None, None), logits)
    both = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = adjust_logits(logits.clone(), both, token_mask([5], 6, logits.device), token_counts([3, 3], 6, logits.device))
    assert torch.equal(out, torch.tensor([2.0, -2.0, 1.0, -2.0 - 2 * 0.5 - 0.25, 0.5, 1.5]))
