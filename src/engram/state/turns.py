"""Conversation records: branches of numbered turns, each turn's exact tokens and messages.

A turn records only what it added to its parent turn (the new prompt tokens and the model's reply
tokens as generated, and the new messages), so a conversation's whole history is rebuilt by
walking parent links. Plain data: where states live is `ConversationManager`'s (conversations.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engram.state.sequence_state import SequenceState
from engram.state.snapshot import SnapshotCorruptError, SnapshotLinkError
from engram.state.staging import DeviceStaging


class ConversationError(Exception):
    """Base of conversation failures; the message says what is wrong."""


class ConversationNotFoundError(ConversationError):
    pass


class ConversationBusyError(ConversationError):
    pass


class ConversationConflictError(ConversationError):
    pass


class StaleViewError(ConversationConflictError):
    """Another process (a replica sharing the store) changed the conversation since this one read
    it: this one's write is refused, and it reads the conversation again before the next turn."""


class TurnMismatchError(ConversationConflictError):
    """The turn the client expected to be the latest is not."""

    def __init__(self, message: str, current_turn: int):
        super().__init__(message)
        self.current_turn = current_turn


class ConversationRecordError(SnapshotCorruptError):
    """A conversation record that cannot be read (the conversation is unusable until it is fixed)."""


# A conversation whose record cannot be read or whose folder holds a link: listings and startup pass it by.
UNUSABLE_CONVERSATION = (ConversationRecordError, SnapshotLinkError)


def ref_name(branch: str, turn: int) -> str:
    return f"{branch}/{turn:06d}"


@dataclass
class TurnAnswer:
    """What the request that made a turn was answered, beyond the turn's tokens and messages: kept so
    that a retry with the same idempotency key is answered the same."""

    idempotency_key: str | None
    finish_reason: str | None
    stop_reason: str | int | None
    completion_tokens: int  # the reply's tokens, at the end of the turn's new tokens (0: appended without a reply)
    cached_tokens: int
    text: str | None = None  # the reply's text, when the recorded message is not all of it (a reply read for tool calls or reasoning)


@dataclass
class Turn:
    branch: str
    turn: int
    parent: str | None  # ref_name of the parent turn
    new_tokens: list[int]  # tokens added to the parent's history: new prompt part + reply as generated
    new_messages: list[dict[str, Any]]  # messages added: the request's new messages + the assistant reply
    state_len: int  # tokens of the full history the turn's state has consumed
    created_at: float = field(default_factory=time.time)
    tool_calls: bool = False
    snapshot: bool = False  # a snapshot file holds this turn's state
    answer: TurnAnswer | None = None  # None: recorded before answers were (or not through the server)

    def __post_init__(self) -> None:
        if isinstance(self.answer, dict):  # read from a record
            self.answer = TurnAnswer(**self.answer)

    @property
    def ref(self) -> str:
        return ref_name(self.branch, self.turn)

    @property
    def reply(self) -> bool:
        """Whether its messages end with the model's reply (not so for one appended with max_tokens 0)."""
        return self.answer is None or self.answer.completion_tokens > 0


@dataclass
class Conversation:
    conversation_id: str
    turns: dict[str, Turn] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    owner: str | None = None  # the tenant that made it; None: made without one (seen only by callers who see all)

    def visible_to(self, tenant: str | None) -> bool:
        """Whether `tenant` may touch it; None: a caller who sees every conversation."""
        return tenant is None or tenant == self.owner

    def latest(self, branch: str) -> Turn | None:
        own = [t for t in self.turns.values() if t.branch == branch]
        return max(own, key=lambda t: t.turn, default=None)

    def chain(self, turn: Turn | None) -> list[Turn]:
        """The turns from the first to `turn`, following parent links across branches."""
        out = []
        while turn is not None:
            out.append(turn)
            turn = self.turns[turn.parent] if turn.parent else None
        return out[::-1]

    def tokens(self, turn: Turn | None) -> list[int]:
        return [t for step in self.chain(turn) for t in step.new_tokens]

    def messages(self, turn: Turn | None) -> list[dict[str, Any]]:
        return [m for step in self.chain(turn) for m in step.new_messages]

    def branches(self) -> list[str]:
        return sorted({t.branch for t in self.turns.values()})

    def heads(self) -> dict[str, Turn]:
        """The latest turn of every branch, by branch name in order."""
        return {t.branch: t for t in sorted(self.turns.values(), key=lambda t: (t.branch, t.turn))}  # the last one stays

    def made_by(self, idempotency_key: str) -> Turn | None:
        """The turn the request with this idempotency key made."""
        return next((t for t in self.turns.values() if t.answer is not None and t.answer.idempotency_key == idempotency_key), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "conversation_id": self.conversation_id,
            "created_at": self.created_at,
            "owner": self.owner,
            "turns": [asdict(t) for t in self.turns.values()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Conversation:
        turns = [Turn(**t) for t in data["turns"]]
        return cls(data["conversation_id"], {t.ref: t for t in turns}, data.get("created_at", time.time()), data.get("owner"))


@dataclass
class TurnPlan:
    """What a new turn starts from: the base turn's exact history and the nearest saved state."""

    conversation_id: str
    branch: str
    turn: int  # the number the new turn will get
    parent: str | None
    history_tokens: list[int]
    history_messages: list[dict[str, Any]]
    state: SequenceState | None
    state_tier: str | None  # "active", "warm" or "cold"; None: the whole history is prefilled
    resume_key: str | None = None  # the engine slot still holding the base turn's state, if any
    host_base: SequenceState | None = None  # that state's warm copy: the turn's capture copies only the KV past it
    load_seconds: float = 0.0  # time spent reading and verifying a snapshot file
    staging: DeviceStaging | None = None  # a cold load's copy of `state` on the engine's device, for the engine to take
    idempotency_key: str | None = None  # the request's, recorded with the turn
    history_ends_with_reply: bool = False  # the base turn's messages end with the model's reply
    forked_from: str | None = None  # "<conversation>@<ref>": the first turn of a conversation that starts from another's turn

    @property
    def ref(self) -> str:
        return ref_name(self.branch, self.turn)


def retain_key(conversation_id: str, ref: str) -> str:
    """The engine's name for the slot that holds a turn's state (the ACTIVE tier)."""
    return f"{conversation_id}@{ref}"
