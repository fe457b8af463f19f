"""Tensor parallelism on CPU (gloo): TP=2 and TP=4 decode what TP=1 decodes, states are captured
in one layout whatever the split, and a conversation saved at one size resumes exactly at another."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from checkpoints import write_checkpoint
from engine_utils import greedy, make_engine, random_prompt, record_logits, run_to_end
from test_conversations import full_generation, manager_for, take_turn

from engram import plan
from engram.args import EngineArgs, add_dataclass_args
from engram.engine import engine as engine_module
from engram.engine import tensor_parallel
from engram.engine.memory_planner import MemoryPlanError
from engram.models.spec import ConfigError

# Shapes every size up to 4 divides: Mamba2 heads and groups, attention heads, gated DeltaNet q/k
# heads (Qwen3-Next's with 2 value heads each), MLP and expert widths; 2 KV heads (Granite,
# Qwen3-Next) are split at TP=2 and replicated at TP=4, Qwen3.5's one is replicated.
_SHAPES = {
    "mamba2": dict(num_heads=8, head_dim=12, n_groups=4),
    "granite": dict(num_attention_heads=8, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=12, mamba_n_groups=4),
    "qwen3_next": dict(linear_num_key_heads=4, linear_num_value_heads=8),
    "qwen3_5": dict(num_attention_heads=8, linear_num_key_heads=4, linear_num_value_heads=4),
    "nemotron": {},  # the test shapes (6 Mamba2 heads in 2 groups): TP=2 only
    "bamba": {},
}
SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """engines(kind, size) -> an engine of that checkpoint at that tensor-parallel size (cached)."""
    made: dict[tuple[str, int], object] = {}
    paths: dict[str, str] = {}

    def get(kind: str, size: int):
        if kind not in paths:
            paths[kind] = str(write_checkpoint(kind, tmp_path_factory.mktemp(f"tp-{kind}"), **_SHAPES[kind]))
        if (kind, size) not in made:
            made[kind, size] = make_engine(paths[kind], tensor_parallel_size=size)
        return made[kind, size]

    yield get
    for engine in made.values():
        engine.close()


PROMPTS = [random_prompt(n, seed) for n, seed in ((37, 1), (12, 2), (50, 3))]


def _decode(engine, max_tokens: int = 12) -> tuple[list[list[int]], list[torch.Tensor]]:
    logits = record_logits(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens))
    out = run_to_end(engine)
    del engine.runner.run  # record_logits' wrapper
    return [out[f"r{i}"].token_ids for i in range(len(PROMPTS))], logits


@pytest.mark.parametrize(
    "kind,sizes", [("mamba2", (2, 4)), ("granite", (2, 4)), ("qwen3_next", (2, 4)), ("qwen3_5", (2, 4)), ("nemotron", (2,)), ("bamba", (2,))]
)
def test_greedy_outputs_and_logits_at_tp2_and_tp4_equal_tp1(kind, sizes, engines):
    tokens, logits = _decode(engines(kind, 1))
    for size in sizes:
        got, got_logits = _decode(engines(kind, size))
        assert got == tokens, f"TP={size}"
        assert len(got_logits) == len(logits)
        # the split sums the row-parallel projections in another order: float32 noise only
        assert max((a - b).abs().max().item() for a, b in zip(got_logits, logits)) < 1e-4


def _capture(engine, prompt: list[int]):
    engine.add_request("head", prompt, greedy(1), capture_state=True)
    return run_to_end(engine)["head"].state


@pytest.mark.parametrize("kind", ["mamba2", "granite", "qwen3_next"])
def test_a_captured_state_has_the_unsharded_layout_at_every_size(kind, engines):
    prompt = PROMPTS[2]
    whole = _capture(engines(kind, 1), prompt)
    for size in (2, 4):
        state = _capture(engines(kind, size), prompt)
        assert state.tokens == whole.tokens and state.state_len == whole.state_len
        assert state.tensors.keys() == whole.tensors.keys()
        for name, t in whole.tensors.items():
            torch.testing.assert_close(state.tensors[name], t, atol=1e-5, rtol=1e-4, msg=f"{name} at TP={size}")


@pytest.mark.parametrize("kind", ["granite", "qwen3_next"])
@pytest.mark.parametrize("saved_at,resumed_at", [(2, 1), (2, 4), (1, 2), (4, 2)])
def test_a_conversation_saved_at_one_size_resumes_exactly_at_another(kind, saved_at, resumed_at, engines, tmp_path):
    """Turn 1 at one size, written to disk; turn 2 at another, from a fresh manager (the snapshot
    file, nothing warm): it computes only its new tokens and continues as a full prefill would."""
    first, second = random_prompt(23, seed=7), random_prompt(9, seed=8)
    saver = engines(kind, saved_at)
    turn, out1, _, _ = take_turn(saver, manager_for(saver, tmp_path), "c", first)
    resumer = engines(kind, resumed_at)
    _, out2, computed, plan = take_turn(resumer, manager_for(resumer, tmp_path), "c", second)
    assert plan.state_tier == "cold"
    assert computed == len(second) + len(plan.history_tokens) - out1.state.state_len
    assert plan.history_tokens == first + out1.token_ids
    assert out2.token_ids == full_generation(engines(kind, 1), plan.history_tokens + second)


def test_a_split_that_does_not_divide_is_refused_naming_the_field(tmp_path, capsys):
    path = write_checkpoint("mamba2", tmp_path / "m", num_heads=8, head_dim=12, n_groups=2)
    with pytest.raises(ConfigError, match="n_groups = 2 is not divisible by --tensor-parallel-size 4"):
        make_engine(str(path), tensor_parallel_size=4)
    with pytest.raises(ValueError, match="--tensor-parallel-size must be at least 1"):
        make_engine(str(path), tensor_parallel_size=0)
    # the test shapes' 2 gated DeltaNet q/k heads (4 value heads) split over 2 ranks, not over 4
    gdn = str(write_checkpoint("qwen3_next", tmp_path / "q"))
    with pytest.raises(ConfigError, match="linear_num_key_heads = 2 is not divisible by --tensor-parallel-size 4"):
        make_engine(gdn, tensor_parallel_size=4)
    assert plan.main(["--model-path", gdn, "--json", "--tensor-parallel-size", "4"]) == 2
    assert "linear_num_key_heads = 2 is not divisible" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kind, architecture", [("falcon_h1", "FalconH1ForCausalLM"), ("lfm2", "Lfm2ForCausalLM"), ("kimi_linear", "KimiLinearForCausalLM")]
)
def test_an_architecture_without_a_split_is_refused_before_any_rank_starts(kind, architecture, checkpoint_dir):
    with pytest.raises(ConfigError, match=f"{architecture} does not run with --tensor-parallel-size > 1"):
        make_engine(checkpoint_dir(kind), tensor_parallel_size=2)


def test_tp_is_an_alias_of_tensor_parallel_size():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineArgs)
    assert parser.parse_args(["--tp", "2"]).tensor_parallel_size == 2
    assert parser.parse_args(["--tensor-parallel-size", "4"]).tensor_parallel_size == 4
    assert parser.parse_args([]).tensor_parallel_size == 1


@pytest.mark.parametrize("kind", ["granite", "qwen3_next"])
def test_plan_sizes_each_ranks_share(kind, engines, capsys):
    path = str(engines(kind, 1).model_path)
    plans = {}
    for size in SIZES:
        assert plan.main(["--model-path", path, "--json", "--tensor-parallel-size", str(size)]) == 0
        plans[size] = json.loads(capsys.readouterr().out)
    one = plans[1]
    for size in (2, 4):
        # Mamba2 heads and groups, gated DeltaNet heads split evenly: the recurrent state per sequence is 1/size of it
        assert plans[size]["state_bytes_per_seq"] * size == one["state_bytes_per_seq"]
        # embeddings, norms and routers are whole on every rank
        assert one["weights_bytes"] / size < plans[size]["weights_bytes"] < one["weights_bytes"]
    # 2 KV heads: one per rank at TP=2, and still one (a replica) at TP=4
    assert plans[2]["kv_bytes_per_token"] * 2 == one["kv_bytes_per_token"] == plans[4]["kv_bytes_per_token"] * 2


def test_a_failed_start_stops_the_other_ranks(engines, monkeypatch):
    started = []

    class Recording(tensor_parallel.Leader):
        def __init__(self, *args):
            super().__init__(*args)
            started.extend(self._procs)

    monkeypatch.setattr(engine_module, "Leader", Recording)
    with pytest.raises(MemoryPlanError, match="exceed the budget"):
        make_engine(str(engines("mamba2", 1).model_path), tensor_parallel_size=2, cpu_memory_gb=1e-6)
    assert len(started) == 1 and not started[0].is_alive()
