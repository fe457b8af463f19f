"""Engine behaviour: chunking, batching, exact split/resume, cancellation, stops, sampling."""

from __future__ import annotations

import time

import pytest
import torch
from checkpoints import GDN_KINDS
from engine_utils import greedy, make_engine, random_prompt, record_logits, run_to_end

from engram.engine.request import FinishReason, SamplingParams
from engram.state.sequence_state import SequenceState

HYBRID_KINDS = ["nemotron", "bamba", "granite_rope", "demo", "falcon_h1", *GDN_KINDS, "lfm2", "kimi_linear"]


def _prefill_logits(path: str, prompt: list[int], chunk: int) -> torch.Tensor:
    engine = make_engine(path, max_num_batched_tokens=chunk)
    logits = record_logits(engine)
    engine.add_request("r", prompt, greedy(1))
    run_to_end(engine)
    rows = [t for t in logits if len(t)]  # steps that only advanced the prefill have no logits
    assert len(rows) == 1
    return rows[0][0]


@pytest.mark.parametrize("kind", ["mamba2", "nemotron", "bamba", "falcon_h1", "qwen3_next", "lfm2", "kimi_linear"])
def test_chunked_prefill_equals_one_shot(kind, checkpoint_dir):
    path = checkpoint_dir(kind)
    prompt = random_prompt(45, seed=3)
    whole = _prefill_logits(path, prompt, 512)
    for chunk in (1, 3, 7, 16):
        torch.testing.assert_close(_prefill_logits(path, prompt, chunk), whole, atol=1e-4, rtol=1e-4)


def _step_kinds(engine) -> list[tuple[bool, bool]]:
    """(has decode rows, has prefill chunks) of every step the engine schedules from now on."""
    kinds = []
    schedule = engine.scheduler.schedule

    def recorded():
        chunks, admitted = schedule()
        decode = {c.seq for c in chunks if c.length == 1 and c.seq not in admitted}
        kinds.append((bool(decode), len(decode) < len(chunks)))
        return chunks, admitted

    engine.scheduler.schedule = recorded
    return kinds


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("kind", ["mamba2", "nemotron"])
def test_mixed_batch_equals_each_alone(kind, mixed, checkpoint_dir):
    path = checkpoint_dir(kind)
    prompts = [random_prompt(n, seed=n) for n in (3, 29, 11, 52, 1)]
    alone = []
    for p in prompts:
        engine = make_engine(path)
        engine.add_request("r", p, greedy(12))
        alone.append(run_to_end(engine)["r"].token_ids)
    engine = make_engine(path, max_num_batched_tokens=24, enable_mixed_chunk=mixed)
    kinds = _step_kinds(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(12))
    together = run_to_end(engine)
    assert [together[f"r{i}"].token_ids for i in range(len(prompts))] == alone
    # mixed: prefill chunks share steps with decodes; not mixed: never, and the two take turns
    assert ((True, True) in kinds) == mixed
    if not mixed:
        prefill_steps = [i for i, (_, prefill) in enumerate(kinds) if prefill]
        assert all(kinds[i + 1] == (True, False) for i in prefill_steps[1:-1] if i + 1 < len(kinds))


@pytest.mark.parametrize("kind", ["mamba2", *HYBRID_KINDS])
@pytest.mark.parametrize("split", [1, 8, 19, 33])
def test_split_prefill_resumed_from_captured_state_equals_unsplit(kind, split, checkpoint_dir):
    path = checkpoint_dir(kind)
    prompt = random_prompt(40, seed=5)
    engine = make_engine(path)
    logits = record_logits(engine)
    engine.add_request("full", prompt, greedy(10))
    full = run_to_end(engine)["full"]
    full_first_logits = logits[0][0]

    engine.add_request("head", prompt[:split], greedy(1), capture_state=True)
    state = run_to_end(engine)["head"].state
    assert state is not None and state.state_len == split and state.tokens[:split] == prompt[:split]
    logits.clear()
    engine.add_request("resumed", prompt, greedy(10), initial_state=state)
    resumed = run_to_end(engine)["resumed"]
    torch.testing.assert_close(logits[0][0], full_first_logits, **_split_logits_tolerance(engine))
    assert resumed.token_ids == full.token_ids
    assert resumed.num_cached_tokens == split


def _split_logits_tolerance(engine) -> dict:
    """float32 logits agree to ~1e-5; bfloat16 ones (the default on CUDA) within kernel noise: the split
    changes which kernels compute which rows (DESIGN.md). On an H200 the largest gap was 0.07."""
    return dict(atol=1e-4, rtol=1e-4) if engine.dtype == torch.float32 else dict(atol=0.125, rtol=0.0)


@pytest.mark.parametrize(
    "kind, suffix",
    [
        ("nemotron", ".k"),
        *(("falcon_h1", suffix) for suffix in (".k", ".ssm", ".conv")),
        *((kind, suffix) for kind in GDN_KINDS for suffix in (".conv", ".recurrent", ".v")),
        *(("lfm2", suffix) for suffix in (".conv", ".k")),
        *(("kimi_linear", suffix) for suffix in (".conv", ".recurrent", ".v")),
    ],
)
def test_resume_without_one_state_tensor_is_refused(kind, suffix, checkpoint_dir):
    engine = make_engine(checkpoint_dir(kind))
    prompt = random_prompt(20, seed=6)
    engine.add_request("head", prompt[:10], greedy(1), capture_state=True)
    state = run_to_end(engine)["head"].state
    dropped = next(name for name in state.tensors if name.endswith(suffix))
    kept = {name: t for name, t in state.tensors.items() if name != dropped}
    with pytest.raises(ValueError, match=f"lacks tensors: {dropped}"):
        engine.add_request("r", prompt, greedy(4), initial_state=SequenceState(state.tokens, state.state_len, kept))


def test_cancel_mid_generation_frees_slot_and_pages(checkpoint_dir):
    engine = make_engine(checkpoint_dir("nemotron"))
    for i in range(3):
        engine.add_request(f"r{i}", random_prompt(30, seed=i), greedy(200))
    for _ in range(5):
        engine.step()
    stats = engine.stats()
    assert stats.num_running == 3 and stats.state_slots_used == 3 and stats.kv_blocks_used > 0
    engine.abort_request("r1")
    assert engine.stats().state_slots_used == 2
    outs = {o.request_id: o for o in engine.step()}
    assert outs["r1"].finished and outs["r1"].finish_reason == FinishReason.ABORT
    engine.abort_request("r0")
    engine.abort_request("r2")
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.state_slots_used, stats.kv_blocks_used) == (0, 0, 0)
    assert not engine.has_unfinished_requests()


def test_queue_time_is_the_wait_for_a_slot(checkpoint_dir):
    """A request that waits for the only slot reports at least the time the first took to finish."""
    engine = make_engine(checkpoint_dir("nemotron"), max_running_requests=1)
    engine.add_request("first", random_prompt(20, seed=1), greedy(6))
    engine.add_request("second", random_prompt(20, seed=2), greedy(6))
    started = time.monotonic()
    queued: dict[str, float | None] = {}
    first_done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            queued.setdefault(out.request_id, out.queue_seconds)
            if out.request_id == "first" and out.finished:
                first_done = time.monotonic()
    assert first_done is not None and queued["first"] is not None and queued["second"] is not None
    assert queued["second"] >= first_done - started > queued["first"]


def _retained_prefixes(engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Run each prompt to its end as a prefix-cache slot; each one's tokens after its state (all but the last)."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(4), prefix_slots="ns:")
    return {rid: prompts[rid] + out.token_ids for rid, out in run_to_end(engine).items()}


def test_requests_holding_adopted_slots_go_past_one_that_waits_for_their_room(checkpoint_dir):
    """An adopted slot is no longer reclaimable: were its request left waiting behind one that needs
    that slot, nothing would run and nothing would free it (the engine would spin for ever)."""
    engine = make_engine(checkpoint_dir("nemotron"), max_running_requests=2)
    done = _retained_prefixes(engine, {f"p{i}": random_prompt(40, seed=i) for i in (1, 2)})
    assert engine.state_pool.num_free == 0 and len(engine.scheduler.retained) == 2
    engine.add_request("new", random_prompt(40, seed=9), greedy(4), prefix_slots="ns:")  # needs a slot both resent histories adopt
    for i in (1, 2):
        engine.add_request(f"a{i}", done[f"p{i}"] + [7, 8], greedy(4), prefix_slots="ns:")
    finished = {}
    for _ in range(100):
        finished |= {o.request_id: o for o in engine.step() if o.finished}
        if not engine.has_unfinished_requests():
            break
    assert set(finished) == {"new", "a1", "a2"}, [s.request_id for s in engine.scheduler.waiting]
    assert [finished[f"a{i}"].num_cached_tokens for i in (1, 2)] == [len(done[f"p{i}"]) - 1 for i in (1, 2)]


def test_prefix_cache_slots_are_reclaimed_before_a_conversations(checkpoint_dir):
    engine = make_engine(checkpoint_dir("nemotron"), max_running_requests=2)
    engine.add_request("turn", random_prompt(30, seed=3), greedy(4), retain_key="conv@1")
    run_to_end(engine)
    _retained_prefixes(engine, {"one-shot": random_prompt(30, seed=4)})  # the last free slot, kept as a prefix-cache slot
    _retained_prefixes(engine, {"another": random_prompt(30, seed=5)})  # takes it back, not the conversation's
    assert list(engine.scheduler.retained) == ["conv@1", "ns:another"]


def test_a_prompt_adopting_a_prefix_slot_captures_only_the_kv_past_its_host_entry(checkpoint_dir):
    """The host entry the prefix cache found (`initial_state`) serves as the capture's base when a
    longer prefix-cache slot is adopted instead: its KV is not copied from the device again."""
    engine = make_engine(checkpoint_dir("nemotron"))
    prompt = random_prompt(300, seed=11)
    engine.add_request("a", prompt, greedy(4), capture_prompt_state=True, prefix_slots="ns:")
    first = run_to_end(engine)["a"]
    host = first.prompt_state
    assert host is not None
    longer = prompt + first.token_ids + random_prompt(40, seed=12)
    before = engine.stats().capture_bytes_total
    engine.add_request("b", longer, greedy(4), initial_state=host, capture_prompt_state=True, prefix_slots="ns:")
    second = run_to_end(engine)["b"]
    copied = engine.stats().capture_bytes_total - before
    recurrent = sum(t.numel() * t.element_size() for t in host.recurrent.values())
    kv_per_token = (host.nbytes - recurrent) / host.state_len
    assert second.num_cached_tokens == len(prompt) + 3  # the slot, not the host entry
    assert copied <= recurrent + kv_per_token * (len(longer) - len(prompt)), (copied, host.nbytes)


def test_stop_conditions(checkpoint_dir):
    engine = make_engine(checkpoint_dir("nemotron"))
    prompt = random_prompt(12, seed=7)
    engine.add_request("base", prompt, greedy(16))
    base = run_to_end(engine)["base"]
    assert base.finish_reason == FinishReason.LENGTH and len(base.token_ids) == 16

    stop_token = base.token_ids[5]
    engine.add_request("tok", prompt, greedy(16, stop_token_ids=[stop_token]))
    out = run_to_end(engine)["tok"]
    first = base.token_ids.index(stop_token)
    assert out.token_ids == base.token_ids[: first + 1] and out.stop_reason == stop_token

    eos = engine.tokenizer.eos_token_id
    engine.add_request("eos", prompt, SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[], ignore_eos=False))
    # The EOS only stops generation when produced; with ignore_eos=True it is generated through.
    out = run_to_end(engine)["eos"]
    assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert (eos in out.token_ids) == (out.finish_reason == FinishReason.STOP)

    text = base.text
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]
    if stop_str:
        engine.add_request("str", prompt, greedy(16, stop=[stop_str]))
        out = run_to_end(engine)["str"]
        assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop_str
        assert out.text == text[: text.index(stop_str)]


def test_seeded_sampling_is_reproducible_and_params_matter(checkpoint_dir):
    engine = make_engine(checkpoint_dir("mamba2"))
    prompt = random_prompt(10, seed=8)

    def sample(**kw) -> list[int]:
        engine.add_request("s", prompt, SamplingParams(max_tokens=20, ignore_eos=True, **kw))
        return run_to_end(engine)["s"].token_ids

    assert sample(seed=1, temperature=1.0) == sample(seed=1, temperature=1.0)
    assert sample(seed=1, temperature=1.0) != sample(seed=2, temperature=1.0)
    greedy_tokens = sample(temperature=0.0)
    # Filters that leave only the most likely token make sampling greedy, whatever the seed.
    assert sample(seed=3, temperature=1.0, top_k=1) == greedy_tokens
    assert sample(seed=4, temperature=2.0, top_p=1e-6) == greedy_tokens
    assert sample(seed=5, temperature=2.0, min_p=1.0) == greedy_tokens
    assert sample(seed=6, temperature=2.0, top_k=3) != greedy_tokens
    assert sample(temperature=0.0, repetition_penalty=5.0) != greedy_tokens
    assert sample(temperature=0.0, frequency_penalty=2.0) != greedy_tokens
    # Penalties above the logits' spread bar every token already in the output: the counts they
    # read must follow each new token (greedy decoding of this model repeats itself).
    assert len(set(greedy_tokens)) < len(greedy_tokens)
    tokens = sample(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(tokens)) == len(tokens)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_are_those_of_the_model(dtype, checkpoint_dir):
    """Of the logits as the model returns them (in its dtype), widened to float32 as the sampler does."""
    engine = make_engine(checkpoint_dir("nemotron"), dtype=dtype)
    logits = record_logits(engine)
    engine.add_request("r", random_prompt(9, seed=9), greedy(3, logprobs=4))
    entries = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            entries.extend(out.logprobs or [])
    assert len(entries) == 3
    for entry, step_logits in zip(entries, logits):
        ref = torch.log_softmax(step_logits[0].float(), dim=-1)
        assert entry.token_id == int(ref.argmax())
        assert abs(entry.logprob - float(ref.max())) < 1e-5
        assert [t for t, _ in entry.top] == ref.topk(4).indices.tolist()


def test_bad_requests_are_refused_with_a_reason(checkpoint_dir):
    engine = make_engine(checkpoint_dir("mamba2"), context_length=64)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], greedy(1))
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("b", random_prompt(60, 1), greedy(10))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("c", [10**6], greedy(1))
    engine.add_request("d", [1, 2], greedy(1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("d", [1, 2], greedy(1))


def test_overloaded_kv_budget_preempts_and_every_request_stays_exact(checkpoint_dir):
    path = checkpoint_dir("nemotron")
    prompts = [random_prompt(24 + i, seed=20 + i) for i in range(4)]
    alone = []
    for p in prompts:
        engine = make_engine(path)
        engine.add_request("r", p, greedy(30))
        alone.append(run_to_end(engine)["r"].token_ids)

    # 4 sequences of ~55 tokens need ~16 pages of 16 tokens; the cache has 6.
    engine = make_engine(path, max_total_tokens=96, context_length=96, kv_block_size=16, max_running_requests=4)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(30))
    peak_blocks = 0
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        peak_blocks = max(peak_blocks, engine.stats().kv_blocks_used)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert peak_blocks <= stats.kv_blocks_total == 6
    assert [finished[f"r{i}"].token_ids for i in range(4)] == alone
    assert (stats.state_slots_used, stats.kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)


@pytest.mark.parametrize(
    "kind, suffixes, head",
    [
        ("nemotron", (".k", ".v"), 30),
        ("falcon_h1", (".k", ".v"), 30),
        ("falcon_h1", (".ssm", ".conv"), 30),
        *((kind, suffixes, 30) for kind in GDN_KINDS for suffixes in ((".k", ".v"), (".conv",), (".recurrent",))),
        ("lfm2", (".k", ".v"), 30),
        # a short conv's window reaches only the next 2 tokens: resumed right before the last one
        ("lfm2", (".conv",), 39),
        *(("kimi_linear", suffixes, 30) for suffixes in ((".k", ".v"), (".conv",), (".recurrent",))),
    ],
)
def test_dropping_a_part_of_a_hybrid_state_changes_the_output(kind, suffixes, head, checkpoint_dir):
    """What a snapshot without one part amounts to (the attention KV, a conv window or the recurrent
    state): the rest restored over zeros there. The continuation differs, so the exactness tests can
    catch it."""
    engine = make_engine(checkpoint_dir(kind))
    prompt = random_prompt(40, seed=11)
    engine.add_request("head", prompt[:head], greedy(1), capture_state=True)
    state = run_to_end(engine)["head"].state
    engine.add_request("exact", prompt, greedy(10), initial_state=state)
    exact = run_to_end(engine)["exact"].token_ids
    engine.add_request("full", prompt, greedy(10))
    assert run_to_end(engine)["full"].token_ids == exact

    zeroed = {name: torch.zeros_like(t) if name.endswith(suffixes) else t for name, t in state.tensors.items()}
    engine.add_request("lossy", prompt, greedy(10), initial_state=SequenceState(state.tokens, state.state_len, zeroed))
    assert run_to_end(engine)["lossy"].token_ids != exact


def test_retained_slot_is_adopted_without_a_copy_and_reclaimed_under_pressure(checkpoint_dir, monkeypatch):
    path = checkpoint_dir("nemotron")
    engine = make_engine(path, max_running_requests=2)
    prompt = random_prompt(30, seed=12)
    engine.add_request("t1", prompt[:20], greedy(1), capture_state=True, retain_key="conv")
    first = run_to_end(engine)["t1"]
    assert engine.stats().retained_slots == 1 and engine.stats().state_slots_used == 1

    restores = []
    monkeypatch.setattr("engram.engine.engine.restore_state", lambda *a: restores.append(a))
    history = first.prompt_token_ids + first.token_ids
    engine.add_request("t2", history + prompt[20:], greedy(8), initial_state=first.state, resume_key="conv")
    resumed = run_to_end(engine)["t2"]
    assert restores == [] and resumed.num_cached_tokens == first.state.state_len
    monkeypatch.undo()
    engine.add_request("full", history + prompt[20:], greedy(8))
    assert run_to_end(engine)["full"].token_ids == resumed.token_ids

    # Two retained slots, then two new requests: the retained ones give way, nothing is preempted.
    for key in ("a", "b"):
        engine.add_request(key, random_prompt(10, seed=len(key)), greedy(2), retain_key=key)
        run_to_end(engine)
    assert engine.stats().retained_slots == 2
    for i in range(2):
        engine.add_request(f"n{i}", random_prompt(12, seed=i), greedy(2))
    run_to_end(engine)
    stats = engine.stats()
    assert stats.retained_slots == 0 and stats.num_preemptions == 0 and stats.state_slots_used == 0

    # A key whose slot was reclaimed falls back to the host copy, still exact.
    engine.add_request("t3", history + prompt[20:], greedy(8), initial_state=first.state, resume_key="a")
    assert run_to_end(engine)["t3"].token_ids == resumed.token_ids
    assert engine.flush_cache() and engine.stats().kv_blocks_used == 0


def test_resumed_request_checks_only_the_tokens_it_computes_and_drops_a_retained_slot_of_another_prompt(checkpoint_dir, monkeypatch):
    """A restored prefix is never computed, so a resumed turn checks only its new tokens against
    the vocabulary (a long history is not checked again), unless a repetition penalty reads the
    whole prompt. A bad new token is refused before the retained slot is touched. A retained slot
    whose tokens are not the prompt's prefix is freed and the prompt computed whole."""
    engine = make_engine(checkpoint_dir("nemotron"), max_running_requests=2)
    prompt = random_prompt(30, seed=21)
    engine.add_request("t1", prompt[:20], greedy(1), capture_state=True, retain_key="conv")
    first = run_to_end(engine)["t1"]
    history = first.prompt_token_ids + first.token_ids
    new = prompt[20:]
    computed = len(history + new) - first.state.state_len  # the generated token is not in the state yet
    checked = []
    check = engine.check_in_vocabulary
    monkeypatch.setattr(engine, "check_in_vocabulary", lambda what, ids: (checked.append((what, len(ids))), check(what, ids))[1])

    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", history + [engine.spec.vocab_size], greedy(2), resume_key="conv")
    assert engine.stats().retained_slots == 1  # untouched by the refused request
    engine.add_request("adopted", history + new, greedy(4), resume_key="conv")
    assert run_to_end(engine)["adopted"].num_cached_tokens == first.state.state_len
    engine.add_request("host", history + new, greedy(4), initial_state=first.state)
    penalized = SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.2)
    engine.add_request("penalized", history + new, penalized, initial_state=first.state)
    run_to_end(engine)
    bad_tail = len(history) + 1 - first.state.state_len
    assert [n for what, n in checked if what == "token ids"] == [bad_tail, computed, computed, len(history + new)]

    engine.add_request("t2", prompt[:20], greedy(1), retain_key="conv")
    run_to_end(engine)
    other = list(reversed(history)) + new
    engine.add_request("other", other, greedy(4), resume_key="conv")
    out = run_to_end(engine)["other"]
    assert out.num_cached_tokens == 0 and engine.stats().retained_slots == 0
    engine.add_request("plain", other, greedy(4))
    assert run_to_end(engine)["plain"].token_ids == out.token_ids


def test_a_request_that_cannot_be_admitted_leaves_the_retained_slots_alone(checkpoint_dir):
    """No free slot and too few pages even with every retained slot's: the request waits, and the
    retained slot (a conversation's ACTIVE state) is not dropped for an admission that fails anyway."""
    engine = make_engine(checkpoint_dir("nemotron"), max_running_requests=2, max_total_tokens=128)
    engine.add_request("keep", random_prompt(20, seed=1), greedy(1), retain_key="conv")
    run_to_end(engine)
    engine.add_request("long", random_prompt(60, seed=2), greedy(20))
    engine.step()  # "long" holds the other slot and 4 of the 8 pages, "keep" 2
    engine.add_request("new", random_prompt(90, seed=3), greedy(2))  # 6 pages: 2 free + 2 reclaimable
    engine.step()
    engine.step()  # decode and prefill steps take turns: one of the two tries to admit "new"
    assert engine.scheduler.waiting and engine.stats().retained_slots == 1
    assert run_to_end(engine).keys() == {"long", "new"}


def test_a_turn_preempted_after_adopting_its_slot_reports_what_it_recomputed(checkpoint_dir):
    """The adopted slot goes back with the preemption; with no host copy to restore, the turn
    recomputes its whole history, and `num_cached_tokens` must say 0, not the adopted length."""
    path = checkpoint_dir("nemotron")
    engine = make_engine(path, max_running_requests=2, max_total_tokens=128)
    engine.add_request("keep", random_prompt(20, seed=1), greedy(1), capture_state=True, retain_key="conv")
    first = run_to_end(engine)["keep"]
    engine.add_request("hog", random_prompt(40, seed=2), greedy(60))
    engine.step()
    turn = first.prompt_token_ids + first.token_ids + random_prompt(9, seed=3)
    engine.add_request("t2", turn, greedy(40), resume_key="conv")
    out = run_to_end(engine)["t2"]
    assert engine.stats().num_preemptions >= 1
    assert out.num_cached_tokens == 0
    reference = make_engine(path)
    reference.add_request("full", turn, greedy(40))
    assert out.token_ids == run_to_end(reference)["full"].token_ids
