"""The tiers' settings (how long a state stays in each, when it is written to the cold one) and
the ACTIVE tier's bookkeeping."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

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


class ActiveTier:
    """The ACTIVE tier's bookkeeping: the finished turns whose engine slot is still retained, by
    (conversation, ref), with their last use, and the slots to hand back to the engine. The slots
    themselves are the scheduler's (`Scheduler.retained`, under `retain_key`: debt 7 of
    docs/ARCHITECTURE.md). Called under the conversation manager's lock."""

    def __init__(self) -> None:
        self._used: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._release: list[str] = []  # engine slots no turn holds any more, handed out by `take_released`

    def __len__(self) -> int:
        return len(self._used)

    def keep(self, conversation_id: str, ref: str, now: float) -> None:
        self._used[(conversation_id, ref)] = now

    def claim(self, conversation_id: str, ref: str) -> float | None:
        """Take the entry of a slot a new request adopts: its last use (None: not held)."""
        return self._used.pop((conversation_id, ref), None)

    def unclaim(self, conversation_id: str, ref: str, last_use: float) -> None:
        self._used[(conversation_id, ref)] = last_use

    def renamed(self, conversation_id: str, ref: str) -> None:
        """The slot under this turn's key is a new turn's now: a forgotten turn's release of the key is void."""
        key = retain_key(conversation_id, ref)
        if key in self._release:
            self._release.remove(key)

    def forget(self, conversation_id: str, ref: str) -> None:
        """The turn is gone: its slot, if held, is handed back."""
        if self._used.pop((conversation_id, ref), None) is not None:
            self._release.append(retain_key(conversation_id, ref))

    def hand_back(self, conversation_id: str, ref: str) -> None:
        """Hand back whatever slot the engine keeps under this turn's key, held here or not."""
        self._used.pop((conversation_id, ref), None)
        self._release.append(retain_key(conversation_id, ref))

    def demote_idle(self, used_before: float) -> int:
        """Hand back the slots last used before `used_before`; how many."""
        idle = [key for key, used in self._used.items() if used < used_before]
        for conversation_id, ref in idle:
            self.forget(conversation_id, ref)
        return len(idle)

    def take_released(self) -> list[str]:
        released, self._release = self._release, []
        return released
