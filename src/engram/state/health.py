"""State health: per-tensor norm anomaly detection and the quarantine of suspect snapshots.

Structural checks (names, shapes, dtypes, finiteness) run on every save and load (`check_state`).
This module adds the statistical part. For each conversation and each state tensor, a
`HealthMonitor` keeps an exponentially weighted mean and variance of the tensor's log RMS. A
checked turn is compared with that baseline and only then folded into it, so a spike is flagged
while a genuine level shift is flagged once or a few times and then becomes the new normal.
`decide` turns a report into what the policy allows (save, restore, quarantine), and `Quarantine`
remembers quarantined snapshots, optionally in a JSON file so they stay quarantined (and are listed
as such) across a restart.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from engram.state.sequence_state import SequenceState
from engram.state.snapshot import atomic_write, read_no_follow

log = logging.getLogger(__name__)

# Floor of the log-norm standard deviation: a 5% change in norm is at most one standard deviation,
# so a perfectly constant history does not turn float noise into an anomaly.
MIN_LOG_STD = 0.05
_TINY_NORM = 1e-30  # an all-zero tensor gets log(1e-30) instead of -inf: very anomalous, but finite


class HealthPolicy(str, Enum):
    LOG_AND_CONTINUE = "log_and_continue"
    SKIP_SNAPSHOT = "skip_snapshot"
    REFUSE_RESTORE = "refuse_restore"


@dataclass(frozen=True)
class HealthConfig:
    check_interval: int = 1  # check every Nth turn of a conversation; 0 disables anomaly checks
    policy: HealthPolicy = HealthPolicy.LOG_AND_CONTINUE
    z_threshold: float = 6.0
    warmup: int = 3  # observations of a tensor before it can be flagged
    ema: float = 0.2  # weight of the newest observation in the baseline

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", HealthPolicy(self.policy))
        if self.check_interval < 0:
            raise ValueError(f"check_interval must be >= 0, got {self.check_interval}")
        if self.z_threshold <= 0:
            raise ValueError(f"z_threshold must be > 0, got {self.z_threshold}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not 0 < self.ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")


def layer_norms(state: SequenceState, kv_from: int = 0) -> dict[str, float]:
    """RMS of each non-empty tensor, computed in float64 with one device sync; attention KV
    (`.k`, `.v`) only over its rows from position `kv_from` (what a turn added: a check costs
    the new tokens, not the history).

    RMS rather than the plain norm so that attention KV, whose rows per turn vary, stays
    comparable across turns.
    """
    named = [*state.recurrent.items(), *((name, state.kv_rows(name, kv_from, state.state_len)) for name in state.kv_names)]
    named = [(name, t) for name, t in named if t.numel()]
    if not named:
        return {}
    device = named[0][1].device
    rms = [(torch.linalg.vector_norm(t.detach(), dtype=torch.float64) / math.sqrt(t.numel())).to(device) for _, t in named]
    return dict(zip((name for name, _ in named), torch.stack(rms).tolist()))


@dataclass(frozen=True)
class Anomaly:
    """`value`, `mean` and `std` are on the natural-log-of-RMS scale; `z = (value - mean) / std`."""

    tensor: str
    value: float
    mean: float
    std: float
    z: float

    def describe(self) -> str:
        if not math.isfinite(self.value):
            return f"{self.tensor} has a non-finite norm ({self.value})"
        return f"{self.tensor} RMS {math.exp(self.value):.4g}, typical {math.exp(self.mean):.4g} (z {self.z:+.1f})"


@dataclass(frozen=True)
class HealthReport:
    conversation_id: str
    turn: int
    checked: bool  # False: not a checked turn (check_interval), nothing was looked at
    anomalies: list[Anomaly]
    at: float

    @property
    def anomalous(self) -> bool:
        return bool(self.anomalies)

    def describe(self) -> str:
        return "; ".join(a.describe() for a in self.anomalies)


@dataclass(frozen=True)
class Decision:
    save: bool  # write the snapshot of this state
    restore: bool  # this state's snapshot may be restored
    quarantine: bool  # record the turn's snapshot as quarantined
    log: str | None  # the warning logged for an anomalous state


@dataclass
class HealthStats:
    checks: int = 0
    anomalies: int = 0  # checks that found at least one anomalous tensor
    quarantined: int = 0
    skipped_saves: int = 0
    refused_restores: int = 0


@dataclass
class _Baseline:
    """Exponentially weighted mean and variance of one tensor's log-norm.

    The weight of a new observation is max(ema, 1/count): the first observations are averaged
    equally (no bias toward the very first one), later ones decay exponentially.
    """

    count: int = 0
    mean: float = 0.0
    var: float = 0.0

    @property
    def std(self) -> float:
        return max(math.sqrt(self.var), MIN_LOG_STD)

    def update(self, x: float, ema: float) -> None:
        self.count += 1
        alpha = max(ema, 1 / self.count)
        diff = x - self.mean
        self.mean += alpha * diff
        self.var = (1 - alpha) * (self.var + alpha * diff * diff)


class HealthMonitor:
    """Per-conversation, per-tensor norm baselines and the policy that acts on anomalies. Thread-safe."""

    def __init__(self, config: HealthConfig = HealthConfig(), clock: Callable[[], float] = time.time):
        self.config = config
        self.stats = HealthStats()
        self._clock = clock
        self._baselines: dict[str, dict[str, _Baseline]] = {}
        self._lock = threading.Lock()

    def check(self, conversation_id: str, turn: int, state: SequenceState, kv_from: int = 0) -> HealthReport:
        """Compare the state's norms (its KV from `kv_from`, see `layer_norms`) with the
        conversation's history, then add them to it."""
        interval = self.config.check_interval
        if interval <= 0 or turn % interval:
            return HealthReport(conversation_id, turn, False, [], self._clock())
        norms = layer_norms(state, kv_from)
        anomalies = []
        with self._lock:
            baselines = self._baselines.setdefault(conversation_id, {})
            for name, norm in norms.items():
                anomaly = self._observe(baselines.setdefault(name, _Baseline()), name, norm)
                if anomaly is not None:
                    anomalies.append(anomaly)
            self.stats.checks += 1
            self.stats.anomalies += bool(anomalies)
        return HealthReport(conversation_id, turn, True, anomalies, self._clock())

    def _observe(self, baseline: _Baseline, name: str, norm: float) -> Anomaly | None:
        seen = baseline.count > 0
        mean, std = (baseline.mean, baseline.std) if seen else (math.nan, math.nan)
        if not math.isfinite(norm):  # always anomalous, and kept out of the baseline
            return Anomaly(name, norm, mean, std, math.inf)
        x = math.log(max(norm, _TINY_NORM))
        anomaly = None
        if seen and baseline.count >= self.config.warmup:
            z = (x - mean) / std
            if abs(z) > self.config.z_threshold:
                anomaly = Anomaly(name, x, mean, std, z)
        baseline.update(x, self.config.ema)
        return anomaly

    def decide(self, report: HealthReport) -> Decision:
        """What the policy allows for the state of `report`; logs a warning if it is anomalous."""
        if not report.anomalous:
            return Decision(save=True, restore=True, quarantine=False, log=None)
        policy = self.config.policy
        save = policy != HealthPolicy.SKIP_SNAPSHOT
        restore = policy != HealthPolicy.REFUSE_RESTORE
        quarantine = policy != HealthPolicy.LOG_AND_CONTINUE
        action = {
            HealthPolicy.LOG_AND_CONTINUE: "continuing",
            HealthPolicy.SKIP_SNAPSHOT: "snapshot skipped, turn quarantined",
            HealthPolicy.REFUSE_RESTORE: "snapshot quarantined, it will not be restored",
        }[policy]
        line = f"state health: conversation {report.conversation_id!r} turn {report.turn}: {report.describe()}; {action} (policy {policy.value})"
        log.warning("%s", line)
        with self._lock:
            self.stats.skipped_saves += not save
            self.stats.quarantined += quarantine
        return Decision(save=save, restore=restore, quarantine=quarantine, log=line)

    def refuses(self, quarantine: Quarantine, conversation_id: str, ref: str) -> bool:
        """Whether the policy forbids restoring this state (quarantined under refuse_restore)."""
        return self.config.policy == HealthPolicy.REFUSE_RESTORE and quarantine.is_quarantined(conversation_id, ref)

    def restore_allowed(self, quarantine: Quarantine, conversation_id: str, ref: str) -> bool:
        """False (counted, logged) for a quarantined snapshot under refuse_restore; a quarantined
        snapshot restored under another policy is logged, never restored silently."""
        if not quarantine.is_quarantined(conversation_id, ref):
            return True
        refuse = self.refuses(quarantine, conversation_id, ref)
        log.warning(
            "state health: conversation %r snapshot %s is quarantined; %s (policy %s)",
            conversation_id,
            ref,
            "refusing to restore it" if refuse else "restoring it anyway",
            self.config.policy.value,
        )
        if refuse:
            with self._lock:
                self.stats.refused_restores += 1
        return not refuse

    def forget(self, conversation_id: str) -> None:
        """Drop a conversation's baselines (it was deleted)."""
        with self._lock:
            self._baselines.pop(conversation_id, None)


class QuarantineListError(ValueError):
    """The quarantine file cannot be read: the server does not start (it would un-quarantine silently)."""


@dataclass
class _Entry:
    conversation_id: str
    ref: str
    reason: str
    at: float


class Quarantine:
    """Quarantined snapshots, keyed by (conversation_id, ref). With a `path`, every change is
    written atomically to that JSON file and the file is read on first use. Thread-safe."""

    def __init__(self, path: str | Path | None = None, clock: Callable[[], float] = time.time):
        self.path = Path(path) if path is not None else None
        self._clock = clock
        self._entries: dict[tuple[str, str], _Entry] | None = None
        self._lock = threading.Lock()

    def _loaded(self) -> dict[tuple[str, str], _Entry]:
        if self._entries is None:
            self._entries = {(e.conversation_id, e.ref): e for e in self._read()}
        return self._entries

    def _read(self) -> list[_Entry]:
        if self.path is None or not (self.path.is_file() or self.path.is_symlink()):
            return []
        try:
            return [_Entry(**e) for e in json.loads(read_no_follow(self.path))["quarantined"]]
        except (OSError, ValueError, KeyError, TypeError) as e:  # never start empty: that would un-quarantine silently
            raise QuarantineListError(
                f"{self.path}: unreadable quarantine list ({e!r}); move it aside, or delete it (which releases every "
                "quarantined snapshot), and start again"
            ) from e

    def _persist(self) -> None:
        if self.path is not None:
            data = {"quarantined": [vars(e) for e in self._loaded().values()]}
            atomic_write(self.path, json.dumps(data, indent=1).encode())

    def add(self, conversation_id: str, ref: str, reason: str) -> dict[str, Any]:
        with self._lock:
            entry = _Entry(conversation_id, ref, reason, self._clock())
            self._loaded()[(conversation_id, ref)] = entry
            self._persist()
            return dict(vars(entry))

    def is_quarantined(self, conversation_id: str, ref: str) -> bool:
        with self._lock:
            return (conversation_id, ref) in self._loaded()

    def list(self, conversation_id: str | None = None) -> list[dict[str, Any]]:
        """Entries sorted by conversation and ref, each {conversation_id, ref, reason, at}."""
        with self._lock:
            entries = [e for e in self._loaded().values() if conversation_id in (None, e.conversation_id)]
        return [dict(vars(e)) for e in sorted(entries, key=lambda e: (e.conversation_id, e.ref))]

    def release(self, conversation_id: str, ref: str | None = None) -> int:
        """Un-quarantine one snapshot, or every one of the conversation if `ref` is None; returns how many."""
        with self._lock:
            entries = self._loaded()
            keys = [k for k in entries if k[0] == conversation_id and ref in (None, k[1])]
            for k in keys:
                del entries[k]
            if keys:
                self._persist()
            return len(keys)
