"""The tiers' settings (how long a state stays in each, when it is written to the cold one) and
the ACTIVE tier's bookkeeping."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from engram.state.turns import retain_key


class SnapshotTrigger(str, Enum):
    EVERY_TURN = "every_turn"
    EVERY_N_TURNS = "every_n_turns"
    ON_TOOL_CALL = "on_tool_call"
    MANUAL_ONLY = "manual_only"


@dataclass(frozen=True)
class TierConfig:
    enabled: bool = True  # ACTIVE and WARM tiers; off: every continuation restores from its snapshot file
    active_timeout: float = 60.0  # seconds idle before a retained engine slot is released
    warm_timeout: float = 1800.0  # seconds idle before a host copy is dropped (the snapshot file stays)
    cold_retention: float = 0.0  # seconds idle before a conversation and its files expire; 0: never
    durability: str = "sync"  # sync: a turn is answered after its snapshot is on disk; async: written behind

    def __post_init__(self) -> None:
        if self.durability not in ("sync", "async"):
            raise ValueError(f"--snapshot-durability must be sync or async, got {self.durability!r}")


@dataclass(frozen=True)
class SnapshotPolicy:
    trigger: SnapshotTrigger = SnapshotTrigger.EVERY_TURN
    every_n_turns: int = 1
    retention_count: int = 0  # snapshots kept per branch; 0 keeps all

    def wants_snapshot(self, turn: int, tool_calls: bool) -> bool:
        if self.trigger == SnapshotTrigger.EVERY_TURN:
            return True
        if self.trigger == SnapshotTrigger.EVERY_N_TURNS:
            return turn % max(1, self.every_n_turns) == 0
        if self.trigger == SnapshotTrigger.ON_TOOL_CALL:
            return tool_calls
        return False


class EngineSlot(Protocol):
    """The engine's handle of a slot it keeps for a finished turn (`RetainedSlot`): the scheduler
    alone frees it (adoption, reclaim under memory pressure, release, a superseding turn) and
    says so through `held`."""

    @property
    def held(self) -> bool: ...


@dataclass
class _Kept:
    last_use: float
    slot: EngineSlot | None  # None: no handle was given (a caller driving the engine itself); held until released

    @property
    def held(self) -> bool:
        return self.slot is None or self.slot.held


class ActiveTier:
    """The ACTIVE tier: the finished turns whose engine slot is still retained, by (conversation,
    ref), with their last use, and the slots to hand back to the engine. Whether a slot is still
    there is the engine's to say (`EngineSlot.held`): an entry whose slot the scheduler reclaimed
    is gone at once, with no copy to bring up to date. Called under the conversation manager's lock."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[str, str], _Kept] = OrderedDict()
        self._release: list[str] = []  # engine slots no turn holds any more, handed out by `take_released`

    def _prune(self) -> None:
        """Drop the entries whose slot the engine freed on its own (memory pressure, a prompt it did not prefix)."""
        for key in [key for key, kept in self._kept.items() if not kept.held]:
            del self._kept[key]

    def __len__(self) -> int:
        self._prune()
        return len(self._kept)

    def holds(self, conversation_id: str, ref: str) -> bool:
        kept = self._kept.get((conversation_id, ref))
        return kept is not None and kept.held

    def keep(self, conversation_id: str, ref: str, now: float, slot: EngineSlot | None = None) -> None:
        self._kept[(conversation_id, ref)] = _Kept(now, slot)

    def claim(self, conversation_id: str, ref: str, now: float) -> bool:
        """Whether the turn's slot is still held, for a new request to adopt (a use, at `now`). An
        entry with the engine's handle stays until the handle says the slot went (adopted,
        reclaimed), so that a request that never comes to adopt it (refused, its client gone)
        leaves it to the idle release; one without a handle is taken out now."""
        key = (conversation_id, ref)
        kept = self._kept.get(key)
        if kept is None or kept.slot is None or not kept.held:
            self._kept.pop(key, None)
        else:
            kept.last_use = now
        return kept is not None and kept.held

    def renamed(self, conversation_id: str, ref: str) -> None:
        """The slot under this turn's key is a new turn's now: a forgotten turn's release of the key is void."""
        key = retain_key(conversation_id, ref)
        if key in self._release:
            self._release.remove(key)

    def forget(self, conversation_id: str, ref: str) -> None:
        """The turn is gone: its slot, if still held, is handed back."""
        kept = self._kept.pop((conversation_id, ref), None)
        if kept is not None and kept.held:
            self._release.append(retain_key(conversation_id, ref))

    def hand_back(self, conversation_id: str, ref: str) -> None:
        """Hand back whatever slot the engine keeps under this turn's key, held here or not."""
        self._kept.pop((conversation_id, ref), None)
        self._release.append(retain_key(conversation_id, ref))

    def demote_idle(self, used_before: float) -> int:
        """Hand back the slots last used before `used_before`; how many."""
        self._prune()
        idle = [key for key, kept in self._kept.items() if kept.last_use < used_before]
        for conversation_id, ref in idle:
            self.forget(conversation_id, ref)
        return len(idle)

    def take_released(self) -> list[str]:
        released, self._release = self._release, []
        return released
