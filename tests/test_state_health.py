"""State health: norm baselines (warmup, spikes, adaptation), check interval, non-finite states,
policy decisions, and the quarantine list across restarts. Synthetic states only."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from engram.state.health import (
    Decision,
    HealthConfig,
    HealthMonitor,
    HealthPolicy,
    HealthReport,
    Quarantine,
    layer_norms,
)
from engram.state.sequence_state import SequenceState


def make_state(seed: int, scale: dict[str, float] | None = None, kv_len: int = 8) -> SequenceState:
    """RMS ~1 random tensors (4096 elements each: sampling noise ~1%), some scaled by `scale`."""
    g = torch.Generator().manual_seed(seed)
    kv = (kv_len, 2, 256)
    shapes = {"layers.0.conv": (4, 1024), "layers.0.ssm": (8, 16, 32), "layers.1.k": kv, "layers.1.v": kv}
    tensors = {name: torch.randn(shape, generator=g) * (scale or {}).get(name, 1.0) for name, shape in shapes.items()}
    return SequenceState(list(range(kv_len + 1)), kv_len, tensors)


def run(monitor: HealthMonitor, conv: str, turns: range, scale: dict[str, float] | None = None) -> list[HealthReport]:
    return [monitor.check(conv, t, make_state(seed=1000 * sum(map(ord, conv)) + t, scale=scale)) for t in turns]


def flagged(reports: list[HealthReport]) -> list[int]:
    return [r.turn for r in reports if r.anomalous]


def anomalous_report(monitor: HealthMonitor) -> HealthReport:
    run(monitor, "c", range(1, 6))
    report = monitor.check("c", 6, make_state(6, {"layers.0.ssm": 20.0}))
    assert report.anomalous
    return report


def test_layer_norms_are_rms_in_float64_and_skip_empty_tensors():
    state = SequenceState(
        [1, 2],
        0,
        {"a": torch.full((3, 5), 2.0, dtype=torch.bfloat16), "b": torch.tensor([3.0, 4.0]), "empty": torch.zeros(0, 2, 4)},
    )
    norms = layer_norms(state)
    assert norms == {"a": 2.0, "b": pytest.approx(math.sqrt(12.5))}
    assert all(type(v) is float for v in norms.values())
    # RMS, not the plain norm: attention KV that grew over turns stays comparable
    short, long = layer_norms(make_state(1, kv_len=4)), layer_norms(make_state(1, kv_len=64))
    assert long["layers.1.k"] == pytest.approx(short["layers.1.k"], rel=0.05)


def test_layer_norms_read_only_the_kv_rows_a_turn_added():
    kv = torch.cat([torch.full((6, 2), 100.0), torch.full((2, 2), 3.0)])
    state = SequenceState(list(range(8)), 8, {"layers.1.k": kv, "layers.0.ssm": torch.full((4,), 100.0)})
    assert layer_norms(state, kv_from=6) == {"layers.1.k": 3.0, "layers.0.ssm": 100.0}
    assert layer_norms(state)["layers.1.k"] > 50


def test_warmup_observations_are_never_flagged():
    for warmup, expect in ((3, []), (2, [3])):
        monitor = HealthMonitor(HealthConfig(warmup=warmup))
        run(monitor, "c", range(1, 3))
        spike = monitor.check("c", 3, make_state(3, {"layers.0.conv": 50.0}))
        assert flagged([spike]) == expect


def test_spike_is_flagged_once_on_its_tensor_only_then_normal_again():
    clock = iter(range(100, 200))
    monitor = HealthMonitor(HealthConfig(), clock=lambda: float(next(clock)))
    assert flagged(run(monitor, "c", range(1, 11))) == []
    spike = monitor.check("c", 11, make_state(11, {"layers.0.ssm": 10.0}))
    assert spike.checked and spike.turn == 11 and spike.conversation_id == "c" and spike.at == 110.0
    [anomaly] = spike.anomalies
    assert anomaly.tensor == "layers.0.ssm"
    assert anomaly.value == pytest.approx(math.log(10.0), abs=0.05)
    assert anomaly.mean == pytest.approx(0.0, abs=0.05)
    assert anomaly.std >= 0.05  # the floor: a near-constant history still has a sane std
    assert anomaly.z == pytest.approx((anomaly.value - anomaly.mean) / anomaly.std) and anomaly.z > 6
    assert "layers.0.ssm" in spike.describe()
    assert flagged(run(monitor, "c", range(12, 20))) == []
    assert monitor.stats.checks == 19 and monitor.stats.anomalies == 1


@pytest.mark.parametrize("factor", [0.0, 0.05])
def test_collapse_is_flagged_too(factor):
    monitor = HealthMonitor(HealthConfig())
    run(monitor, "c", range(1, 8))
    [anomaly] = monitor.check("c", 8, make_state(8, {"layers.1.v": factor})).anomalies
    assert anomaly.tensor == "layers.1.v" and anomaly.z < -6 and math.isfinite(anomaly.value)


def test_persistent_shift_is_flagged_a_few_times_then_becomes_the_new_normal():
    monitor = HealthMonitor(HealthConfig())
    run(monitor, "c", range(1, 11))
    shifted = run(monitor, "c", range(11, 41), scale={"layers.0.conv": 30.0})
    assert 11 in flagged(shifted) and len(flagged(shifted)) <= 3
    assert flagged(shifted[5:]) == []
    # and a return to the old level is itself a shift: flagged, then adapted to
    back = run(monitor, "c", range(41, 61))
    assert 41 in flagged(back) and flagged(back[5:]) == []


def test_constant_history_does_not_flag_tiny_noise():
    monitor = HealthMonitor(HealthConfig())
    const = SequenceState([0], 0, {"x": torch.ones(64)})
    for t in range(1, 11):
        assert not monitor.check("c", t, const).anomalous
    assert not monitor.check("c", 11, SequenceState([0], 0, {"x": torch.ones(64) * 1.1})).anomalous
    assert monitor.check("c", 12, SequenceState([0], 0, {"x": torch.ones(64) * 2.0})).anomalous


def test_check_interval_checks_only_every_nth_turn_and_only_those_feed_the_baseline():
    monitor = HealthMonitor(HealthConfig(check_interval=3, warmup=2))
    nan_state = make_state(0, {"layers.0.ssm": math.nan})
    for turn in range(1, 31):
        # unchecked turns are wild (even non-finite) and must neither be flagged nor feed the baseline
        state = make_state(turn) if turn % 3 == 0 else (nan_state if turn % 2 else make_state(turn, {"layers.0.conv": 1e3}))
        report = monitor.check("c", turn, state)
        assert report.checked == (turn % 3 == 0)
        assert not report.anomalous
    assert monitor.stats.checks == 10 and monitor.stats.anomalies == 0

    disabled = HealthMonitor(HealthConfig(check_interval=0))
    reports = [disabled.check("c", t, nan_state) for t in range(1, 5)]
    assert not any(r.checked or r.anomalous for r in reports) and disabled.stats.checks == 0


def test_non_finite_norm_is_always_an_anomaly_and_does_not_poison_the_baseline():
    monitor = HealthMonitor(HealthConfig())
    [first] = monitor.check("c", 1, make_state(1, {"layers.1.k": math.nan})).anomalies  # during warmup
    assert first.tensor == "layers.1.k" and math.isnan(first.value) and first.z == math.inf
    assert math.isnan(first.mean) and math.isnan(first.std)  # nothing seen yet for that tensor
    run(monitor, "c", range(2, 8))
    [later] = monitor.check("c", 8, make_state(8, {"layers.0.conv": math.inf})).anomalies
    assert later.value == math.inf and later.z == math.inf and math.isfinite(later.mean)
    assert "non-finite" in later.describe()
    assert flagged(run(monitor, "c", range(9, 12))) == []


def test_conversations_and_tensors_have_independent_baselines():
    monitor = HealthMonitor(HealthConfig())
    run(monitor, "a", range(1, 11), scale={"layers.0.ssm": 100.0})  # a's normal is b's anomaly
    run(monitor, "b", range(1, 11))
    assert flagged(run(monitor, "a", range(11, 13), scale={"layers.0.ssm": 100.0})) == []
    [anomaly] = monitor.check("b", 11, make_state(11, {"layers.0.ssm": 100.0})).anomalies
    assert anomaly.tensor == "layers.0.ssm"
    # a spike in one conversation leaves the other's baseline alone
    monitor.check("a", 13, make_state(13, {"layers.1.k": 1e4}))
    assert flagged(run(monitor, "b", range(12, 15))) == []
    # a conversation that is forgotten starts over (warmup again)
    monitor.forget("a")
    assert not monitor.check("a", 14, make_state(14)).anomalous


def test_unflagged_report_allows_everything_under_every_policy():
    for policy in HealthPolicy:
        monitor = HealthMonitor(HealthConfig(policy=policy))
        report = monitor.check("c", 1, make_state(1))
        assert monitor.decide(report) == Decision(save=True, restore=True, quarantine=False, log=None)
        assert monitor.stats.quarantined == monitor.stats.skipped_saves == 0


@pytest.mark.parametrize(
    "policy, save, restore, quarantine",
    [
        (HealthPolicy.LOG_AND_CONTINUE, True, True, False),
        (HealthPolicy.SKIP_SNAPSHOT, False, True, True),
        (HealthPolicy.REFUSE_RESTORE, True, False, True),
    ],
)
def test_decision_of_each_policy(policy, save, restore, quarantine, caplog):
    monitor = HealthMonitor(HealthConfig(policy=policy))
    report = anomalous_report(monitor)
    with caplog.at_level(logging.WARNING, logger="engram.state.health"):
        decision = monitor.decide(report)
    assert (decision.save, decision.restore, decision.quarantine) == (save, restore, quarantine)
    assert decision.log is not None and "'c'" in decision.log and "turn 6" in decision.log
    assert "layers.0.ssm" in decision.log and policy.value in decision.log
    assert [r.getMessage() for r in caplog.records] == [decision.log]
    assert monitor.stats.skipped_saves == int(not save)
    assert monitor.stats.quarantined == int(quarantine)


@pytest.mark.parametrize("policy, allowed", [("log_and_continue", True), ("skip_snapshot", True), ("refuse_restore", False)])
def test_restore_of_a_quarantined_snapshot(policy, allowed, caplog):
    monitor = HealthMonitor(HealthConfig(policy=policy))
    quarantine = Quarantine()
    quarantine.add("c", "main/000006", "layers.0.ssm RMS 20")
    assert monitor.restore_allowed(quarantine, "c", "main/000005")
    with caplog.at_level(logging.WARNING, logger="engram.state.health"):
        assert monitor.restore_allowed(quarantine, "c", "main/000006") == allowed
    assert "quarantined" in caplog.text  # never restored silently
    assert monitor.stats.refused_restores == int(not allowed)


def test_quarantine_persists_across_a_new_instance(tmp_path):
    path = tmp_path / "health" / "quarantine.json"
    q = Quarantine(path, clock=lambda: 123.0)
    assert q.list() == [] and not path.exists()
    entry = q.add("conv-b", "main/000003", "layers.0.ssm RMS 20")
    assert entry == {"conversation_id": "conv-b", "ref": "main/000003", "reason": "layers.0.ssm RMS 20", "at": 123.0}
    q.add("conv-a", "main/000002", "nan")
    q.add("conv-a", "alt/000004", "spike")
    assert path.is_file() and not [p for p in path.parent.iterdir() if p != path]  # no temp files left

    restarted = Quarantine(path)
    assert restarted.is_quarantined("conv-b", "main/000003")
    assert not restarted.is_quarantined("conv-b", "main/000002")
    assert [(e["conversation_id"], e["ref"]) for e in restarted.list()] == [
        ("conv-a", "alt/000004"),
        ("conv-a", "main/000002"),
        ("conv-b", "main/000003"),
    ]
    assert restarted.list("conv-b") == [entry]

    assert restarted.release("conv-a", "main/000002") == 1
    assert restarted.release("conv-a", "main/000002") == 0
    assert [e["ref"] for e in Quarantine(path).list("conv-a")] == ["alt/000004"]
    assert restarted.release("conv-a") == 1  # the whole conversation (e.g. it was deleted)
    assert [e["conversation_id"] for e in Quarantine(path).list()] == ["conv-b"]


def test_unreadable_quarantine_file_is_an_error_not_an_empty_list(tmp_path):
    path = tmp_path / "quarantine.json"
    path.write_text("{not json")
    q = Quarantine(path)  # lazy: nothing is read yet
    with pytest.raises(ValueError, match="unreadable quarantine list"):
        q.is_quarantined("c", "main/000001")


def test_config_validation_and_policy_from_a_string():
    assert HealthConfig(policy="refuse_restore").policy is HealthPolicy.REFUSE_RESTORE
    for bad in ({"check_interval": -1}, {"z_threshold": 0}, {"warmup": -1}, {"ema": 0}, {"ema": 1.5}, {"policy": "retry"}):
        with pytest.raises(ValueError):
            HealthConfig(**bad)
