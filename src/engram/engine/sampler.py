"""Next-token choice from logits: logit bias, penalties, temperature, top-k, top-p, min-p, seeded
sampling, and logprobs of the model's own distribution.

Logits may live on the GPU and come in the model's dtype: every computation on them is in float32
(an argmax needs none). `sample_on_device` picks the tokens of every row without penalties,
logit bias or a seed of its own at once, on the logits' device and with no host sync: greedy rows
take the argmax, the others filter in one batch and draw by an exponential race (the argmax of
p / Exp(1), which picks token i with probability p_i) from the engine's generator on that device.
`sample_batch` takes a whole step: those rows go through `sample_on_device`, the others through
`sample_adjusted` in one batch, which applies each row's bias and penalties and filters on the
logits' device and draws by inverse CDF from one uniform per row, taken from the request's own
(CPU) generator when it has a seed: a seeded row's token depends on neither the device nor the
rows beside it, and a step of seeded rows costs one host round trip, not one per row."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engram.engine.request import SamplingParams, TokenLogprob
from engram.ops.dispatch import kernels


def token_counts(token_ids: list[int], size: int, device: torch.device) -> torch.Tensor:
    """[size] int64: how many times each token id occurs."""
    return torch.bincount(torch.tensor(token_ids, dtype=torch.long, device=device), minlength=size)


def token_mask(token_ids: list[int], size: int, device: torch.device) -> torch.Tensor:
    """[size] bool, True at the given token ids."""
    return token_counts(token_ids, size, device) > 0


def adjust_logits(logits: torch.Tensor, params: SamplingParams, prompt_mask: torch.Tensor | None, output_counts: torch.Tensor | None) -> torch.Tensor:
    """The logit bias, then vLLM's penalties: repetition over prompt and output, frequency and
    presence over the output. `prompt_mask` ([V] bool, `token_mask` of the prompt; None: an empty
    prompt) is made once per request and `output_counts` ([V], `token_counts` of the output so far;
    None: no output yet) kept up to date as tokens come, so that neither a long prompt nor a long
    output costs anything per step but vector operations over the vocabulary."""
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    in_output = output_counts > 0 if output_counts is not None else None
    if params.repetition_penalty != 1.0:
        seen = prompt_mask
        if in_output is not None:
            seen = in_output if seen is None else seen | in_output
        if seen is not None:
            penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
            logits = torch.where(seen, penalized, logits)
    if (params.frequency_penalty or params.presence_penalty) and output_counts is not None:
        counts = output_counts.to(logits.dtype)
        logits = logits - (params.frequency_penalty * counts + params.presence_penalty * (output_counts > 0).to(logits.dtype))
    return logits


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, min-p and top-p masks (masked entries become -inf), row i of
    `logits` [R, V] with params[i] (sampling rows: temperature > 0)."""

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]

    logits = logits / column([p.temperature for p in params])
    ks = [min(p.top_k, logits.shape[-1]) if p.top_k > 0 else 0 for p in params]  # 0: top-k off
    if any(ks):
        largest = torch.topk(logits, max(ks)).values  # [R, max k], descending
        kth = largest.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=logits.device)[:, None])
        kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=logits.device)[:, None], -torch.inf)
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < column([p.min_p for p in params]) * probs.amax(-1, keepdim=True), -torch.inf)
    if any(p.top_p < 1.0 for p in params):
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        top_p = column([p.top_p if p.top_p < 1.0 else 2.0 for p in params])  # 2: off, whatever the rounding
        drop = probs.cumsum(-1) - probs >= top_p  # keep the token that crosses top_p
        drop[:, 0] = False  # and the most likely one, however small top_p (or its rounding to 0)
        logits = logits.masked_fill(drop.scatter(1, order, drop), -torch.inf)
    return logits


def sample_adjusted(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: list[tuple[torch.Tensor | None, torch.Tensor | None]],
    generators: list[torch.Generator | None],
    device_generator: torch.Generator,
) -> torch.Tensor:
    """Token ids [R] for rows of `logits` [R, V] with a logit bias, penalties (history[i]: row i's
    prompt mask and output counts) or a seed of their own (generators[i], on the CPU)."""
    adjusted = torch.stack([adjust_logits(row.to(torch.float32, copy=True), p, *h) for row, p, h in zip(logits, params, history)])
    tokens = adjusted.argmax(-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if not drawn:
        return tokens
    probs = torch.softmax(filter_logits(adjusted[drawn], [params[i] for i in drawn]), dim=-1)
    cdf = probs.double().cumsum(-1)
    u = torch.empty(len(drawn), dtype=torch.float64, device=logits.device).uniform_(generator=device_generator)
    seeded = [j for j, i in enumerate(drawn) if generators[i] is not None]
    if seeded:
        own = [float(torch.rand(1, dtype=torch.float64, generator=generators[drawn[j]])) for j in seeded]
        u[torch.tensor(seeded, device=u.device)] = torch.tensor(own, dtype=torch.float64).to(u.device)
    # the first token whose cumulative probability exceeds u x total: one of positive probability, as u < 1
    chosen = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
    tokens[torch.tensor(drawn, device=tokens.device)] = chosen
    return tokens


def samples_on_device(params: SamplingParams) -> bool:
    """Whether `sample_on_device` serves a row: no penalties or logit bias, no seed of its own for a
    random draw."""
    return not params.adjusts_logits and (params.greedy or params.seed is None)


def sample_on_device(
    logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator, out: torch.Tensor | None = None, argmax_done: bool = False
) -> torch.Tensor:
    """Token ids [R] (int64, on the logits' device) for rows that `samples_on_device` serves.
    `argmax_done`: `out` already holds each row's argmax (a decode graph took it)."""
    if argmax_done:
        assert out is not None, "argmax_done: `out` holds the argmax"
        tokens = out
    else:
        tokens = kernels().argmax(logits, out=out)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        rows = torch.tensor(drawn, device=logits.device)
        probs = torch.softmax(filter_logits(logits[rows].float(), [params[i] for i in drawn]), dim=-1)
        race = probs / torch.empty_like(probs).exponential_(generator=generator)
        tokens[rows] = kernels().argmax(race)
    return tokens


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: Callable[[int], tuple[torch.Tensor | None, torch.Tensor | None]],
    generators: list[torch.Generator | None],
    device_generator: torch.Generator,
) -> list[int]:
    """One token per row of `logits` [R, V]. `generators[i]`: row i's own generator (a seeded
    request) or None; `device_generator` (on the logits' device) draws for every other row.
    `history(i)` gives row i's (prompt mask, output counts) for `adjust_logits`, asked only for rows
    whose penalties need them."""
    tokens = [0] * len(params)
    batched = [i for i, p in enumerate(params) if samples_on_device(p)]
    if batched:
        whole = len(batched) == len(params)
        rows = logits if whole else logits[torch.tensor(batched, device=logits.device)]
        chosen = sample_on_device(rows, params if whole else [params[i] for i in batched], device_generator)
        for i, t in zip(batched, chosen.tolist()):
            tokens[i] = t
    rest = sorted(set(range(len(params))) - set(batched))
    if rest:
        chosen = sample_adjusted(
            logits[torch.tensor(rest, device=logits.device)],
            [params[i] for i in rest],
            [history(i) if params[i].has_penalties else (None, None) for i in rest],
            [generators[i] for i in rest],
            device_generator,
        )
        for i, t in zip(rest, chosen.tolist()):
            tokens[i] = t
    return tokens


def token_logprob(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    entry = TokenLogprob(token_id, float(logprobs[token_id]))
    if top:
        values, ids = logprobs.topk(top)
        entry.top = list(zip(ids.tolist(), values.tolist()))
    return entry


def prompt_token_logprobs(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """`token_logprob` of each row of `logits` [R, V] and token_ids[i], with its rank, in one pass."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device)[:, None])
    ranks = (logprobs > chosen).sum(-1).add(1).tolist()
    entries = [TokenLogprob(t, v, rank=r) for t, v, r in zip(token_ids, chosen[:, 0].tolist(), ranks)]
    if top:
        values, ids = logprobs.topk(top)
        for entry, row_ids, row_values in zip(entries, ids.tolist(), values.tolist()):
            entry.top = list(zip(row_ids, row_values))
    return entries
