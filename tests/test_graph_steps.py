"""The runner's decode-graph path on the CPU. A stand-in for the CUDA graph re-runs the captured step
on the same static buffers, so the path's bookkeeping is checked without a GPU: the two staged input
buffers and the host's two rows of tokens taken in turn, the input tokens gathered from `sampled`
(in flight) or from the sent ids, the argmax left in `sampled`, padding rows and bucket sizes. The real graphs run in test_gpu_capture.py and
test_gpu_ops.py on a GPU."""

from __future__ import annotations

import gc

import pytest
import torch
from checkpoints import write_checkpoint
from engine_utils import ContinuationDrafter, greedy, make_engine, random_prompt, run_to_end

from engram.engine import runner as runner_mod
from engram.engine.request import SamplingParams


class _Replayed:
    """Replays by running the captured step again into the output the capture returned."""

    def __init__(self, forward, out: torch.Tensor):
        self.forward, self.out = forward, out

    def replay(self) -> None:
        self.out.copy_(self.forward())


class _NoEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _record(runner, forward) -> tuple[_Replayed, torch.Tensor]:
    """As the real capture: two warm-up runs, then the run whose output the replays refill."""
    forward()
    forward()
    out = forward()
    return _Replayed(forward, out), out


@pytest.fixture
def cpu_graphs(monkeypatch):
    """The decode-graph path with its CUDA parts stood in for: graphs, events, pinned memory."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    monkeypatch.setattr(runner_mod.ModelRunner, "record", _record)
    monkeypatch.setattr(runner_mod.ModelRunner, "_prefill_graph_usable", lambda self, chunks: False)
    monkeypatch.setattr(runner_mod.ModelRunner, "_graphs_enabled", lambda self: self.enable_cuda_graph)  # not only on CUDA


def _workload(engine) -> tuple[dict, int]:
    """Greedy, unseeded and seeded draws and a request admitted mid-way (batches of 1-3 sequences:
    several graph buckets); returns each request's tokens and the graph replays."""
    prompt = random_prompt(12, seed=21)
    engine.add_request("greedy", prompt, greedy(14))
    engine.add_request("free", random_prompt(7, seed=22), SamplingParams(max_tokens=11, temperature=0.9, ignore_eos=True))
    engine.add_request("seeded", prompt, SamplingParams(max_tokens=9, temperature=1.1, seed=4, ignore_eos=True))
    outputs = {}
    for _ in range(5):
        for out in engine.step():
            outputs[out.request_id] = out
    engine.add_request("late", random_prompt(9, seed=23), greedy(6))
    outputs.update(run_to_end(engine))
    return {r: o.token_ids for r, o in outputs.items() if o.finished}, engine.runner.num_graph_replays


def test_decode_graph_steps_give_the_eager_steps_tokens(cpu_graphs, checkpoint_dir):
    path = checkpoint_dir("mamba2")
    # on the CPU even on a GPU machine: the stand-ins do not wait for the device as CUDA events would
    expected, eager_replays = _workload(make_engine(path, device="cpu", enable_cuda_graph=False, enable_overlap_schedule=True))
    got, replays = _workload(make_engine(path, device="cpu", enable_cuda_graph=True, enable_overlap_schedule=True))
    assert eager_replays == 0 and replays >= 10
    assert got == expected and len(got) == 4


def test_lfm2_decode_steps_run_in_graphs_with_the_eager_steps_tokens(cpu_graphs, tmp_path):
    """LFM2's short conv on padded decode steps (slot -1 rows). Short-conv layers only: the torch
    reference of paged attention reads the host lengths, which a graph's batch holds as placeholders."""
    path = str(write_checkpoint("lfm2", tmp_path, layer_types=["conv"] * 4))
    expected, _ = _workload(make_engine(path, device="cpu", enable_cuda_graph=False, enable_overlap_schedule=True))
    got, replays = _workload(make_engine(path, device="cpu", enable_cuda_graph=True, enable_overlap_schedule=True))
    assert replays >= 10
    assert got == expected and len(got) == 4


@pytest.mark.parametrize("enabled", [True, False])
def test_the_cyclic_collector_is_paused_while_a_graph_is_captured(enabled):
    """A collection inside a capture can free another engine's graphs or events: that call invalidates
    the capture (seen on an H200 with several engines in one process)."""
    (gc.enable if enabled else gc.disable)()
    try:
        with runner_mod._garbage_collection_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
    finally:
        gc.enable()


def test_a_capture_keeps_the_tokens_of_the_graph_step_before(cpu_graphs, checkpoint_dir):
    """Two greedy requests, then one (a new bucket): the capture's warm-ups run right after a graph
    step whose tokens are still on their way, in the host's rows that the warm-ups write too."""
    path = checkpoint_dir("mamba2")

    def run(engine) -> dict:
        engine.add_request("long", random_prompt(10, seed=31), greedy(12))
        engine.add_request("short", random_prompt(6, seed=32), greedy(4))
        return {r: o.token_ids for r, o in run_to_end(engine).items()}

    expected = run(make_engine(path, device="cpu", enable_cuda_graph=False, enable_overlap_schedule=True))
    engine = make_engine(path, device="cpu", enable_cuda_graph=True, enable_overlap_schedule=True)
    assert run(engine) == expected
    assert sorted(engine.runner._graphs) == [1, 2]


# recurrent layers only, as above: Mamba2, gated DeltaNet, short conv
_RECURRENT_ONLY = {"mamba2": {}, "qwen3_next": {"layer_types": ["linear_attention"] * 4}, "lfm2": {"layer_types": ["conv"] * 4}}


@pytest.mark.parametrize("arch", list(_RECURRENT_ONLY))
@pytest.mark.parametrize("wrong", [False, True])
def test_verify_steps_in_graphs_give_the_eager_steps_tokens(cpu_graphs, tmp_path, arch, wrong):
    """Speculative verify steps replayed from graphs (engine/verify_graphs.py): drafts padded to k + 1
    tokens, padding sequences in wider buckets, the states committed from the graphs' buffers; the
    tokens are plain greedy decoding's. Recurrent layers only, as above."""
    path = str(write_checkpoint(arch, tmp_path, **_RECURRENT_ONLY[arch]))
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    prompts = [random_prompt(10 + i, seed=41 + i) for i in range(3)]

    def run(engine) -> list[list[int]]:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy(12 + 3 * i))
        out = run_to_end(engine)
        return [prompts[i] + out[f"r{i}"].token_ids for i in range(len(prompts))]

    expected = run(make_engine(path, device="cpu", enable_cuda_graph=False))
    engine = make_engine(path, device="cpu", enable_cuda_graph=True, speculative_config=ngram)
    assert engine.speculator.pad_drafts
    engine.speculator.drafter = ContinuationDrafter(expected, wrong)
    verify = [size for kind, size in engine.runner.capturable_buckets() if kind == "verify"]
    assert verify == [1, 2, 4, 8]  # the decode buckets up to --max-running-requests
    for kind, size in engine.runner.capturable_buckets():  # as the warm-up does
        if kind != "prefill":  # no prefill graphs here (`cpu_graphs`)
            engine.runner.capture(kind, size)
    assert engine.stats().state_slots_used == 0  # the slot the commits' captures wrote went back
    replays, captures = engine.runner.num_graph_replays, engine.runner.num_graph_captures
    assert run(engine) == expected
    stats = engine.stats()
    assert engine.runner.num_graph_captures == captures  # none on the requests' path
    assert engine.runner.num_graph_replays - replays >= 5 and stats.spec_draft_tokens_total > 20
    assert (stats.spec_accepted_tokens_total == 0) == wrong
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0


def test_verify_graphs_captured_on_the_requests_path_with_every_slot_taken(cpu_graphs, checkpoint_dir):
    """Without the warm-up's captures (as bench_spec runs an engine), the first verify step of a
    bucket captures its graphs while every state slot is some request's: the commit's capture then
    runs on the step's own entries (writing the states the commit writes) instead of a free slot."""
    path = checkpoint_dir("mamba2")
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    prompts = [random_prompt(10 + i, seed=61 + i) for i in range(3)]

    def run(engine) -> list[list[int]]:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy(10))
        out = run_to_end(engine)
        return [prompts[i] + out[f"r{i}"].token_ids for i in range(len(prompts))]

    expected = run(make_engine(path, device="cpu", enable_cuda_graph=False, max_running_requests=3))
    engine = make_engine(path, device="cpu", enable_cuda_graph=True, speculative_config=ngram, max_running_requests=3)
    assert engine.state_pool.num_slots == 3
    engine.speculator.drafter = ContinuationDrafter(expected, False)
    assert run(engine) == expected
    assert engine.stats().spec_accepted_tokens_total > 0 and engine.runner.num_graph_captures > 0
