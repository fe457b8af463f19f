"""Conversations: their records (state/turns.py) and where each turn's state lives.

The record is one JSON document per conversation in the COLD store (a file beside its snapshots,
or an object in a bucket shared by replicas), replaced whole on every change. States live in the
warm cache (host memory) and, per the trigger policy, in snapshot files; a continuation restores
the nearest turn that has one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, overload

from engram.models.spec import ModelSpec
from engram.state.chunks import DEFAULT_CHUNK_TOKENS, ORPHAN_GRACE_S, PrefixHasher, StoredState
from engram.state.cold import ColdStore
from engram.state.eviction import ComputeSavedPolicy, PrefillCost
from engram.state.exchange import export_of, read_import, write_imported
from engram.state.health import HealthMonitor, Quarantine
from engram.state.host_arena import HostArena
from engram.state.identity import ModelIdentity
from engram.state.keyed_locks import KeyedLocks
from engram.state.object_store import open_cold_store
from engram.state.prefix_cache import PrefixCache
from engram.state.prefix_disk import PrefixDisk
from engram.state.records import RecordFiles, decode_record, encode_record
from engram.state.sequence_state import SequenceState, StateDtypes
from engram.state.snapshot import (
    QUARANTINE_NAME,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotNotFoundError,
    dtype_names,
    validate_id,
)
from engram.state.snapshot import RECORD_NAME as RECORD_NAME  # re-exported: the record's name, as this module's callers know it
from engram.state.snapshots import TurnSnapshots
from engram.state.staging import DeviceStaging
from engram.state.store import Clock, SnapshotWriter, TierStats, WarmCache
from engram.state.tiers import ActiveTier, EngineSlot, SnapshotPolicy, SnapshotTrigger, TierConfig
from engram.state.transfer import write_export
from engram.state.turns import (
    UNUSABLE_CONVERSATION,
    Conversation,
    ConversationBusyError,
    ConversationConflictError,
    ConversationNotFoundError,
    ConversationRecordError,
    StaleViewError,
    Turn,
    TurnAnswer,
    TurnMismatchError,
    TurnPlan,
    ref_name,
    retain_key,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class ConversationManager:
    """The turn registry, warm states and snapshot files of every conversation. Thread-safe.

    Two kinds of lock. `_lock` (the manager's) guards what memory holds: which conversations are
    loaded and busy, the WARM and ACTIVE tiers, the counters; it is held only while those change,
    never across a call to the COLD store. `_held` gives each conversation its own lock, held
    across its record and manifest round trips (which an object store makes network calls), so
    that a slow or stalled store delays only the conversation waiting on it. A conversation's
    record and its `Conversation` are changed only under its own lock (and additions or removals
    of turns also under `_lock`, which readers of every conversation take). A thread holds at
    most one conversation's lock, and takes it before `_lock`, never while holding `_lock`."""

    def __init__(
        self,
        spec: ModelSpec,
        dtypes: StateDtypes,
        model: ModelIdentity,
        tokenizer_sha256: str,
        policy: SnapshotPolicy,
        snapshot_dir: str | Path | None,
        warm: WarmCache,
        tiers: TierConfig = TierConfig(),
        clock: Clock = time.time,
        health: HealthMonitor | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        prefix_cache_bytes: int = 0,
        prefix_cache_min_tokens: int = 1,
        prefix_cache_disk_bytes: int = 0,
        store_url: str | None = None,
        staging_device: torch.device | None = None,
        host_arena_bytes: int = 0,
    ):
        self.spec, self.dtypes, self.model, self.tokenizer_sha256 = spec, dtypes, model, tokenizer_sha256
        self.policy = policy
        self._lock = threading.RLock()
        self._held = KeyedLocks()
        self.stats = TierStats()
        self.root = Path(snapshot_dir) if snapshot_dir is not None else None
        identity = json.dumps(
            {"model": asdict(model), "tokenizer": tokenizer_sha256, "layout": spec.layout(), "dtypes": dtype_names(dtypes)}, sort_keys=True
        ).encode()
        hasher = PrefixHasher(identity, chunk_tokens)
        # `store_url`: an object store shared with other replicas (state/object_store.py), `snapshot_dir` its cache.
        store = open_cold_store(store_url, self.root, spec, dtypes, hasher, model, tokenizer_sha256) if self.root is not None else None
        self.store: ColdStore | None = store
        self.records = store.records if store is not None else None  # the folder's side of the records (the store's cache for an object store)
        self.turn_snapshots = TurnSnapshots(self.store, self.stats, self._lock) if self.store is not None else None
        # States after whole prompts, for requests of no conversation (0 bytes: prefix caching off),
        # also kept on disk (0 bytes, or no store: memory only); both tiers evict by the compute a byte saves.
        eviction = ComputeSavedPolicy(PrefillCost.of(spec))
        self.prefix_disk = (
            PrefixDisk(self.store, hasher, prefix_cache_disk_bytes, eviction, clock)
            if prefix_cache_bytes > 0 and prefix_cache_disk_bytes > 0 and self.store is not None
            else None
        )
        if self.prefix_disk is not None:
            self.prefix_disk.on_evict = self._mark_sweep_due
        self.prefix_cache = (
            PrefixCache(hasher, prefix_cache_bytes, prefix_cache_min_tokens, self.prefix_disk, eviction) if prefix_cache_bytes > 0 else None
        )
        self.orphan_grace_s = ORPHAN_GRACE_S  # store files younger than this are never swept (a save may still reference them)
        # Due at start (a crash may have left unreferenced files), but not at once: startup reads no record.
        self._sweep_due, self._next_sweep = True, clock() + 60.0
        self.tiers = tiers
        self.clock = clock
        self.warm = warm
        self.warm.clock = clock
        self.warm.on_evict = self._evicted
        self.active = ActiveTier()
        # Cold loads copy the state to this device (the engine's) while they read it; None: the engine copies the host state.
        # They read into blocks of an arena of `host_arena_bytes`, page-locked here, once, while it has room.
        self.staging_device = staging_device
        self.host_arena = (
            HostArena(host_arena_bytes, pin=staging_device.type == "cuda") if staging_device is not None and host_arena_bytes > 0 else None
        )
        self.last_used: dict[str, float] = {}  # conversation -> last use (for cold expiry)
        self._next_expiry_scan = 0.0
        self.writer = SnapshotWriter() if tiers.durability == "async" and self.root is not None else None
        self.health = health or HealthMonitor(clock=clock)
        self.quarantine = Quarantine(self.root / QUARANTINE_NAME if self.root is not None else None, clock=clock)
        self.quarantine.list()  # read now: an unreadable list stops the start with its message, not every later request
        self._conversations: dict[str, Conversation] = {}
        self._busy: dict[str, str | None] = {}  # conversation -> the idempotency key of its request in flight
        self._unsaved_by_health: set[tuple[str, str]] = set()  # turns whose state the health policy kept off disk
        self._unrecorded: set[str] = set()  # async: conversations whose answered turns a failed record write left out
        self._leaving: list[tuple[str, str, SequenceState]] = []  # states pushed out of memory, to write once no lock is held

    def _mark_sweep_due(self) -> None:
        self._sweep_due = True

    def _count(self, family: str, key: str) -> None:
        getattr(self.stats, family)[key] += 1

    @property
    def persistent(self) -> bool:
        return self.root is not None

    def _saved(self) -> TurnSnapshots:
        """The turns' snapshots; SnapshotError when persistence is off."""
        if self.turn_snapshots is None:
            raise SnapshotError("snapshot persistence is disabled (start the server with --enable-snapshot-persistence)")
        return self.turn_snapshots

    # ---- records -----------------------------------------------------------------------------

    def get(self, conversation_id: str) -> Conversation | None:
        """The conversation, loaded from the store on first access (startup indexes nothing), and
        again when another replica sharing the store has changed it since."""
        validate_id(conversation_id, "conversation_id")
        with self._held.hold(conversation_id):
            with self._lock:
                conv = self._conversations.get(conversation_id)
                busy = conversation_id in self._busy  # set only under this conversation's lock: it does not become busy meanwhile
            if self.store is None or self.records is None:
                return conv
            if conv is not None and not busy and not self.store.record_current(conversation_id):
                self._drop_stale(conversation_id)
                conv = None
            if conv is None:
                data = self.store.read_record(conversation_id)
                if data is not None:
                    conv = decode_record(conversation_id, data)
                    with self._lock:
                        self._conversations[conversation_id] = conv
                    self._remove_orphans(conv, self.records)
            return conv

    def _drop_stale(self, conversation_id: str) -> None:
        """Forget what memory holds of a conversation another replica changed (its files are the
        store's): its turns' states, which may be of turns the store now records differently; a
        slot still held for one is handed back to the engine."""
        with self._lock:
            conv = self._conversations.pop(conversation_id, None)
            for ref in conv.turns if conv is not None else ():
                self.active.forget(conversation_id, ref)
                if self.turn_snapshots is not None:
                    self.turn_snapshots.forget(conversation_id, ref)
            self.warm.drop(conversation_id)

    def _remove_orphans(self, conv: Conversation, records: RecordFiles) -> None:
        """Delete snapshot files the record does not point at: a crash between a snapshot's commit
        and its record's leaves one, for a turn that was never recorded (so never answered under
        sync durability). In a store other replicas share, a recent one may be a turn whose record
        is about to be written: it is left for a later load."""
        saved = self._saved()
        for location in saved.unrecorded(conv):
            if saved.store.written_within(location, self.orphan_grace_s):  # another replica's turn, its record next
                continue
            log.warning("removing snapshot %s: its conversation record does not list it (left by a crash)", location)
            saved.store.delete(location)
            self._sweep_due = True
        records.remove_stale_temp_files(conv.conversation_id)

    def require(self, conversation_id: str, tenant: str | None = None) -> Conversation:
        """The conversation, if `tenant` may see it (None: any); another tenant's is not found, as a
        missing one (its existence is not confirmed)."""
        conv = self.get(conversation_id)
        if conv is None or not conv.visible_to(tenant):
            raise ConversationNotFoundError(f"conversation {conversation_id!r} not found")
        return conv

    def _persist(self, conv: Conversation) -> None:
        """Write the conversation's record (after the snapshot files it lists: the caller's order),
        under its lock. A replica sharing the store that changed it first (StaleViewError): this
        one's copy is dropped."""
        if self.store is not None:
            try:
                self.store.write_record(conv.conversation_id, encode_record(conv))
            except StaleViewError:
                self._drop_stale(conv.conversation_id)
                raise
            self._unrecorded.discard(conv.conversation_id)

    def list_ids(self) -> list[str]:
        with self._lock:
            loaded = set(self._conversations)
        return sorted(loaded | set(self.store.record_ids() if self.store is not None else ()))

    def visible(self, tenant: str | None, after: str | None = None, limit: int | None = None) -> list[Conversation]:
        """The conversations `tenant` may see (None: all), in id order, from the first id past
        `after`, at most `limit`. An unreadable record is logged and left out."""
        out: list[Conversation] = []
        for cid in self.list_ids():
            if limit is not None and len(out) >= limit:
                break
            if after is not None and cid <= after:
                continue
            try:
                conv = self.get(cid)
            except ConversationRecordError as e:
                log.warning("listing conversations: %s", e)
                continue
            if conv is not None and conv.turns and conv.visible_to(tenant):
                out.append(conv)
        return out

    # ---- turns --------------------------------------------------------------------------------

    @overload
    def find_turn(self, conv: Conversation, branch: str, turn: int) -> Turn: ...
    @overload
    def find_turn(self, conv: Conversation, branch: str, turn: int | None) -> Turn | None: ...

    def find_turn(self, conv: Conversation, branch: str, turn: int | None) -> Turn | None:
        """Turn `turn` as seen from `branch` (its own turns or an ancestor's; for a branch without
        turns yet, the one it forks from, main's); the latest if None."""
        if turn is None:
            return conv.latest(branch)
        source = branch if conv.latest(branch) is not None else "main"
        match = next((t for t in conv.chain(conv.latest(source)) if t.turn == turn), None)
        if match is None:
            raise ConversationNotFoundError(f"conversation {conv.conversation_id!r} has no turn {turn} on branch {branch!r}")
        return match

    def begin(
        self,
        conversation_id: str,
        branch: str = "main",
        from_turn: int | None = None,
        tenant: str | None = None,
        idempotency_key: str | None = None,
        expected_turn: int | None = None,
        from_conversation: str | None = None,
    ) -> TurnPlan | Turn:
        """Reserve the conversation for one new turn (409 if already busy) and say what it starts
        from. A cold load happens outside the manager's lock: other conversations go on meanwhile.
        A new conversation belongs to `tenant`; another tenant's is not found. Returns the turn that
        `idempotency_key` already made, if any (nothing reserved); refuses a new turn unless the
        branch's latest is `expected_turn` (0: none yet), when given. With `from_conversation`, a
        new conversation starts from turn `from_turn` (default: the latest) of that one's main
        branch, which `tenant` must be able to see; its first turn records the whole history, so
        it does not depend on the source afterwards."""
        validate_id(conversation_id, "conversation_id")
        validate_id(branch, "branch")
        # The source is read first: a thread never holds two conversations' locks (one waiting on the other's could deadlock).
        fork: Conversation | ConversationNotFoundError | None = None
        if from_conversation is not None:
            try:
                fork = self.require(validate_id(from_conversation, "from_conversation"), tenant)
            except ConversationNotFoundError as e:  # reported after this conversation's own checks
                fork = e
        with self._held.hold(conversation_id):
            conv = self.get(conversation_id) or Conversation(conversation_id, owner=tenant)
            with self._lock:
                if not conv.visible_to(tenant):
                    raise ConversationNotFoundError(f"conversation {conversation_id!r} not found")
                made = conv.made_by(idempotency_key) if idempotency_key is not None else None
                if made is not None:
                    return made
                if conversation_id in self._busy:
                    if idempotency_key is not None and self._busy[conversation_id] == idempotency_key:
                        raise ConversationBusyError(
                            f"the turn with Idempotency-Key {idempotency_key!r} is still in flight; retry once it has finished to get its answer"
                        )
                    raise ConversationBusyError(f"conversation {conversation_id!r} already has a request in flight")
                latest = conv.latest(branch)
                current = latest.turn if latest is not None else 0
                if expected_turn is not None and expected_turn != current:
                    raise TurnMismatchError(f"expected_turn is {expected_turn} but the latest turn of branch {branch!r} is {current}", current)
                if from_turn is None and branch != "main" and conv.turns and latest is None:
                    raise ConversationNotFoundError(f"branch {branch!r} does not exist; pass from_turn to fork it")
                source = conv if fork is None else self._fork_source(conv, fork)
                base = self.find_turn(source, branch if source is conv else "main", from_turn)
                if source is not conv and base is None:
                    raise ConversationNotFoundError(f"conversation {from_conversation!r} has no turns to start from")
                if base is not None and base.branch == branch and source is conv:
                    self._check_regenerable(conv, base)
                self._conversations.setdefault(conversation_id, conv)
                self._busy[conversation_id] = idempotency_key
                now = self.last_used[conversation_id] = self.clock()
                adoptable = base is not None and source is conv and not self.health.refuses(self.quarantine, conversation_id, base.ref)
                claimed = adoptable and base is not None and self.active.claim(conversation_id, base.ref, now)
                host_base = self.warm.peek(conversation_id, base.ref) if claimed and base is not None else None
        forked = source is not conv
        plan = TurnPlan(
            conversation_id=conversation_id,
            branch=branch,
            turn=1 if forked or base is None else base.turn + 1,
            parent=base.ref if base and not forked else None,
            history_tokens=source.tokens(base),
            history_messages=source.messages(base),
            state=None,
            state_tier=None,
            idempotency_key=idempotency_key,
            history_ends_with_reply=base is not None and base.reply,
            forked_from=f"{from_conversation}@{base.ref}" if forked and base else None,
        )
        if claimed and base is not None:  # the new request adopts the slot: nothing is fetched (`fall_back` if it cannot)
            plan.state_tier, plan.resume_key, plan.host_base = "active", retain_key(conversation_id, base.ref), host_base
            with self._lock:
                self._count("hits", "active")
            return plan
        try:
            self._fetch_state(plan, source, base)
        except BaseException:
            self.release(conversation_id)
            raise
        return plan

    def fall_back(self, plan: TurnPlan) -> None:
        """The slot `begin` found was gone when the request came to adopt it (reclaimed meanwhile):
        fetch the state the turn starts from instead (warm or cold), and count that tier's hit."""
        assert plan.parent is not None and plan.resume_key is not None
        with self._lock:
            conv = self._conversations[plan.conversation_id]
            base = conv.turns[plan.parent]
            self.stats.hits["active"] -= 1
        plan.resume_key = plan.host_base = None
        self._fetch_state(plan, conv, base)

    def _fetch_state(self, plan: TurnPlan, conv: Conversation, base: Turn | None) -> None:
        """Put into `plan` the nearest state of `base`'s chain (warm, or read from the cold tier) and count its tier."""
        started = time.perf_counter()
        staging = self.new_staging()
        plan.state, plan.state_tier = self._nearest_state(conv, base, staging)
        plan.staging = staging if staging is not None and staging.state is not None and plan.state_tier == "cold" else None
        plan.load_seconds = time.perf_counter() - started if plan.state_tier == "cold" else 0.0
        with self._lock:
            if base is not None and plan.state_tier is None:
                self.stats.misses += 1
            elif plan.state_tier is not None:
                self._count("hits", plan.state_tier)

    def new_staging(self, stage: bool = True) -> DeviceStaging | None:
        """Where one cold load (a turn's, a prefix cache entry's) copies its state to the engine's
        device as it reads (without `stage`: only where it reads into, the arena or pinned memory);
        None: the engine copies the host state itself."""
        return DeviceStaging(self.staging_device, arena=self.host_arena, stage=stage) if self.staging_device is not None else None

    def tier_of(self, conversation_id: str, turn: Turn) -> str | None:
        """Where the turn's state is now: "active" (an engine slot), "warm" (host memory), "cold"
        (a snapshot); None: nowhere (recomputed from its tokens when needed)."""
        with self._lock:
            if self.active.holds(conversation_id, turn.ref):
                return "active"
            if self.warm.peek(conversation_id, turn.ref) is not None:
                return "warm"
        return "cold" if turn.snapshot else None

    @staticmethod
    def _fork_source(conv: Conversation, source: Conversation | ConversationNotFoundError) -> Conversation:
        if conv.turns:
            raise ConversationConflictError(f"conversation {conv.conversation_id!r} already has turns: from_conversation starts a new one")
        if isinstance(source, ConversationNotFoundError):
            raise source
        return source

    def _check_regenerable(self, conv: Conversation, base: Turn) -> None:
        later = {t.ref for t in conv.turns.values() if t.branch == base.branch and t.turn > base.turn}
        for t in conv.turns.values():
            if t.parent in later and t.branch != base.branch:
                raise ConversationConflictError(f"turn {t.parent} is the parent of branch {t.branch!r}; continue into a new branch instead")

    def _nearest_state(self, conv: Conversation, base: Turn | None, staging: DeviceStaging | None = None) -> tuple[SequenceState | None, str | None]:
        """The state of the latest turn in the base's chain that still has one, and its tier
        (`staging`: where a cold load also copies it to the device)."""
        for turn in reversed(conv.chain(base)):
            if not self.health.restore_allowed(self.quarantine, conv.conversation_id, turn.ref):
                continue  # quarantined under refuse_restore: an earlier state, or recomputation
            with self._lock:
                state = self.warm.get(conv.conversation_id, turn.ref)
            if state is not None:
                return state, "warm"
            try:
                return self.load_into_warm(conv.conversation_id, turn, staging), "cold"
            except SnapshotNotFoundError:
                continue
            except SnapshotCorruptError as e:  # a damaged file costs a recomputation, not the conversation
                log.warning("conversation %s: %s; resuming from an earlier state", conv.conversation_id, e)
                if not isinstance(e.__cause__, OSError):  # damage, not a read that failed (it may work next time)
                    self._quarantine_damaged(conv.conversation_id, turn.ref, str(e))
                continue
        return None, None

    def _quarantine_damaged(self, conversation_id: str, ref: str, reason: str) -> None:
        try:
            self.quarantine.add(conversation_id, ref, f"unreadable snapshot: {reason}")
        except OSError as e:  # the turn goes on from an earlier state all the same
            log.warning("conversation %s: the quarantine list could not be written: %s", conversation_id, e)

    def finish(
        self,
        plan: TurnPlan,
        prompt_tokens: list[int],
        output_tokens: list[int],
        new_messages: list[dict[str, Any]],
        state: SequenceState | None,
        tool_calls: bool = False,
        answer: TurnAnswer | None = None,
        retained: EngineSlot | None = None,
    ) -> Turn:
        """Record the turn, keep its state warm (and its engine slot active: `retained`, the
        engine's handle of it, says while it is), snapshot it per the policy (now, or written
        behind with async durability), release the conversation."""
        cid = plan.conversation_id
        try:
            with self._held.hold(cid):
                with self._lock:
                    conv = self._conversations[cid]
                    turn = Turn(
                        branch=plan.branch,
                        turn=plan.turn,
                        parent=plan.parent,
                        new_tokens=prompt_tokens[0 if plan.forked_from else len(plan.history_tokens) :] + output_tokens,
                        new_messages=plan.history_messages + new_messages if plan.forked_from else new_messages,
                        state_len=state.state_len if state else 0,
                        tool_calls=tool_calls,
                        answer=answer,
                    )
                    replaced = [t for t in conv.turns.values() if t.branch == plan.branch and t.turn >= plan.turn]
                    recorded = bool(replaced) and self.writer is None
                if recorded:  # sync: the regenerated turns are forgotten only once the record no longer lists them
                    self._persist_replacing(conv, replaced, turn)
                for t in replaced:
                    self._forget_turn(conv, t)
                with self._lock:
                    conv.turns[turn.ref] = turn
                    self.active.renamed(cid, turn.ref)  # a forgotten turn's key, now naming this turn's slot
                    now = self.clock()
                    self.last_used[cid] = now
                    wanted = state is not None and self.persistent and self.policy.wants_snapshot(turn.turn, tool_calls)
                    parent = conv.turns.get(plan.parent) if plan.parent else None
                    if state is not None and not self._healthy(cid, turn, state, parent.state_len if parent else 0):
                        wanted = False
                        self._unsaved_by_health.add((cid, turn.ref))
                    if state is not None and self.tiers.enabled:
                        if not self.warm.fits(state):  # it cannot stay in memory: written now, as any state leaving it
                            wanted = wanted or self._written_on_leaving_memory(cid, turn.ref)
                        self.warm.put(cid, turn.ref, state)
                        self.active.keep(cid, turn.ref, now, retained)
            job = functools.partial(self._commit, conv, turn, state if wanted else None, recorded)
            if self.writer is not None:
                self.writer.submit(job)
            else:
                job()
            return turn
        finally:
            self.release(cid)
            self._write_leaving()

    def _healthy(self, conversation_id: str, turn: Turn, state: SequenceState, kv_from: int) -> bool:
        """Check the state's norms (its KV from `kv_from`: what the turn added) against the
        conversation's history; quarantine per the policy. Returns whether the state may be
        written as a snapshot."""
        report = self.health.check(conversation_id, turn.turn, state.wait(), kv_from)
        decision = self.health.decide(report)
        if decision.quarantine:
            self.quarantine.add(conversation_id, turn.ref, report.describe())
        return decision.save

    def _persist_replacing(self, conv: Conversation, replaced: list[Turn], turn: Turn) -> None:
        """Write the record with `turn` (without its snapshot yet) in place of the turns it
        regenerates, before anything of theirs is forgotten: a record that cannot be written
        leaves them as they were, on disk and in memory. The engine slot kept under the new turn's
        key holds the failed turn's state then, and is handed back."""
        gone = {t.ref for t in replaced}
        turns = {ref: t for ref, t in conv.turns.items() if ref not in gone}
        try:
            self._persist(Conversation(conv.conversation_id, {**turns, turn.ref: turn}, conv.created_at))
        except (OSError, StaleViewError):
            with self._lock:
                self.active.hand_back(conv.conversation_id, turn.ref)
            raise

    def _commit(self, conv: Conversation, turn: Turn, state: SequenceState | None, recorded: bool = False) -> None:
        """Write the turn's snapshot (if any) and then the record that points at it. A snapshot
        that cannot be written is logged and counted: the turn is recorded without it (its state
        is recomputed from its tokens when needed). A record that cannot be written undoes the
        turn, so that memory never holds a turn the disk lacks; unless the record already holds
        it (`recorded`: a regenerate's, see `_persist_replacing`), then only its snapshot is left out.

        The snapshot file (the whole history's KV) is written outside both locks, so other
        conversations' turns go on meanwhile; this one is still reserved (sync) or is checked
        again after the write (async: a turn forgotten meanwhile leaves an orphan file, removed on
        the next load, and its manifest names the old turn, so it is never loaded for a new one).
        The record is written under the conversation's lock alone."""
        cid = conv.conversation_id
        with self._held.hold(cid):
            if conv.turns.get(turn.ref) is not turn:  # forgotten meanwhile (regenerated or deleted)
                return
            base = self._saved().stored_base(conv, turn) if state is not None else None
        written = False
        if state is not None:
            try:
                self._save_file(conv, turn, state, base)
                written = True
            except (SnapshotError, OSError) as e:
                log.warning("snapshot of conversation %r turn %s not written, the turn is recorded without it: %s", cid, turn.ref, e)
        with self._held.hold(cid):
            if conv.turns.get(turn.ref) is not turn:
                return
            turn.snapshot = turn.snapshot or written
            if recorded and not turn.snapshot:
                return
            try:
                self._persist_and_prune(conv, turn.branch)
            except (OSError, StaleViewError) as e:  # StaleViewError: the snapshot just written is of a turn the store records otherwise
                if recorded:  # the file it points at is an orphan, removed on the next load
                    turn.snapshot = False
                    log.warning("conversation %r turn %s is recorded without its snapshot: %s", conv.conversation_id, turn.ref, e)
                    return
                if self.writer is None:  # sync: the request fails; async: it was answered, a later write records it
                    self._forget_turn(conv, turn)
                else:
                    self._unrecorded.add(cid)
                raise

    def release(self, conversation_id: str) -> None:
        with self._lock:
            self._busy.pop(conversation_id, None)
            conv = self._conversations.get(conversation_id)
            if conv is not None and not conv.turns:  # its first turn failed: there is no conversation
                del self._conversations[conversation_id]
                self.last_used.pop(conversation_id, None)

    # ---- snapshots ------------------------------------------------------------------------------

    def _write_snapshot(self, conv: Conversation, turn: Turn, state: SequenceState) -> None:
        self._save_file(conv, turn, state, self._saved().stored_base(conv, turn))
        turn.snapshot = True

    def _stored_of(self, conversation_id: str, turn: Turn) -> StoredState | None:
        return self._saved().stored_of(conversation_id, turn)

    def _save_file(self, conv: Conversation, turn: Turn, state: SequenceState, base: StoredState | None) -> None:
        """Write the turn's snapshot; the record does not point at it yet."""
        stored = self._saved().save(conv, turn, state, base)
        if self.prefix_disk is not None and self.prefix_cache is not None and self.prefix_cache.wants(state.state_len):
            self.prefix_disk.index(state, stored)  # a prefix other requests may begin with: an entry naming the snapshot's files

    def _beyond_retention(self, conv: Conversation, branch: str, extra: Turn | None = None) -> list[Turn]:
        """The turns of `branch` whose snapshots the retention count drops (counting `extra` as saved)."""
        keep = self.policy.retention_count
        saved = sorted((t for t in conv.turns.values() if t.branch == branch and (t.snapshot or t is extra)), key=lambda t: t.turn)
        return saved[:-keep] if keep > 0 else []

    def _persist_and_prune(self, conv: Conversation, branch: str) -> None:
        """Write the record, then delete the snapshots the retention count drops from `branch`. The
        record stops listing them first: a crash in between leaves files it does not list, which
        the next load removes as orphans, never a record that points at a deleted file."""
        dropped = self._beyond_retention(conv, branch)
        for t in dropped:
            t.snapshot = False
        try:
            self._persist(conv)
        except OSError:
            for t in dropped:
                t.snapshot = True
            raise
        for t in dropped:
            try:
                self._delete_turn_file(conv.conversation_id, t)
            except OSError as e:  # the record no longer lists it: an orphan, removed on the next load
                log.warning("snapshot %s beyond the retention count not deleted: %s", t.ref, e)

    def _delete_turn_file(self, conversation_id: str, turn: Turn) -> None:
        self._sweep_due = True
        with contextlib.suppress(SnapshotNotFoundError):
            self._saved().delete(conversation_id, turn.branch, turn.turn)

    def save(self, conversation_id: str, branch: str = "main", turn: int | None = None) -> Turn:
        """Write a snapshot of a turn whose state is still held (the manual trigger)."""
        self._saved()
        with self._held.hold(conversation_id):
            conv = self.require(conversation_id)
            target = self.find_turn(conv, branch, turn)
            if target is None:
                raise ConversationNotFoundError(f"conversation {conversation_id!r} has no turns on branch {branch!r}")
            if not target.snapshot:
                if target in self._beyond_retention(conv, target.branch, extra=target):
                    raise ConversationConflictError(
                        f"turn {target.ref} is older than the {self.policy.retention_count} newest snapshots of branch "
                        f"{target.branch!r} that --snapshot-retention-count keeps: its snapshot would be deleted at once"
                    )
                with self._lock:
                    state = self.warm.get(conversation_id, target.ref)
                if state is None:
                    raise ConversationConflictError(f"the state of turn {target.ref} is no longer held in memory; it cannot be saved now")
                self._write_snapshot(conv, target, state)
                self._persist_and_prune(conv, target.branch)
            return target

    def _load_turn(self, conversation_id: str, turn: Turn, staging: DeviceStaging | None = None) -> SequenceState:
        """Load and verify the turn's snapshot, taking the KV a warm state holds from it."""
        saved = self._saved()
        conv = self.require(conversation_id)
        return saved.load(conv, turn, self._resident_prefix(conv, turn), staging)

    def _resident_prefix(self, conv: Conversation, turn: Turn) -> SequenceState | None:
        """The warm state that shares the longest prefix with the turn's history (a later turn, a
        sibling branch, another conversation with the same system prompt), whose KV a load takes
        instead of reading it (a position's KV depends only on the tokens before it, as the store's
        shared pieces do). Not a quarantined turn's: health checked only the KV that turn added,
        not the rows it would lend."""
        tokens = conv.tokens(turn)
        with self._lock:
            candidates = [state for cid, ref, state in self.warm.states() if not self.quarantine.is_quarantined(cid, ref)]
        best, best_len = None, 0
        for state in candidates:
            n = _common_prefix(state.tokens, tokens, state.state_len)
            if n > best_len:
                best, best_len = state, n
        return best

    def snapshots(self, conversation_id: str | None = None) -> list[dict[str, Any]]:
        """Manifest and path of every snapshot the conversation records point at, in order of
        conversation, branch and turn (the records are the source of truth, see `get`). An
        unreadable record or snapshot is logged and left out."""
        self._saved()
        out = []
        for cid in [conversation_id] if conversation_id is not None else self.list_ids():
            try:
                conv = self.get(cid)
            except UNUSABLE_CONVERSATION as e:
                log.warning("listing snapshots: %s", e)
                continue
            for turn in sorted(conv.turns.values(), key=lambda t: (t.branch, t.turn)) if conv else ():
                try:
                    out.append(self.snapshot_manifest(cid, turn))
                except SnapshotNotFoundError:
                    continue
                except SnapshotError as e:
                    log.warning("listing snapshots: %s", e)
        return out

    def snapshot_manifest(self, conversation_id: str, turn: Turn) -> dict[str, Any]:
        saved = self._saved()
        return saved.manifest(self.require(conversation_id), turn)

    def snapshot_tokens(self, manifest: dict[str, Any]) -> list[int]:
        """The token ids a snapshot covers (its `fill_ids`), read without the state tensors."""
        return self._saved().store.tokens(manifest)

    def load_into_warm(self, conversation_id: str, turn: Turn, staging: DeviceStaging | None = None) -> SequenceState:
        """The turn's state, from the warm cache or its verified snapshot file (then kept warm;
        `staging` gets its device copy; without one the load still reads into pinned memory on
        CUDA, so that no later restore from the WARM copy waits on pageable memory). The file is read
        without holding the manager's lock; the caller holds no conversation's lock (the states this
        one pushes out of memory are written here)."""
        with self._lock:
            state = self.warm.get(conversation_id, turn.ref)
        if state is not None:
            return state
        if not turn.snapshot:
            raise SnapshotNotFoundError(f"turn {turn.ref} of conversation {conversation_id!r} has no snapshot and no state in memory")
        state = self._load_turn(conversation_id, turn, staging if staging is not None else self.new_staging(stage=False))
        if self.tiers.enabled:
            with self._lock:
                self.warm.put(conversation_id, turn.ref, state)
                self._count("promotions", "cold_to_warm")
            self._write_leaving()
        return state

    def delete_snapshot(self, conversation_id: str, branch: str, turn: int) -> None:
        saved = self._saved()
        with self._held.hold(conversation_id):
            saved.delete(conversation_id, branch, turn)
            self._sweep_due = True
            conv = self.get(conversation_id)
            target = conv.turns.get(ref_name(branch, turn)) if conv else None
            if conv is not None and target is not None:
                target.snapshot = False
                self._persist(conv)

    def delete_conversation(self, conversation_id: str, tenant: str | None = None) -> None:
        """Forget the conversation and delete its files (also when its record is unreadable, unless
        for a `tenant`: whose it is cannot be told); a link in its folder refuses it all, before
        anything is forgotten."""
        with self._held.hold(conversation_id):
            if self.records is not None:
                self.records.check_folder(conversation_id)
            try:
                conv = self.require(conversation_id, tenant)
            except ConversationRecordError:
                if tenant is not None:
                    raise
                conv = None
            with self._lock:
                if conversation_id in self._busy:  # set only under this conversation's lock: no turn begins meanwhile
                    raise ConversationBusyError(f"conversation {conversation_id!r} has a request in flight")
            if conv is not None:
                for t in list(conv.turns.values()):
                    self._forget_turn(conv, t)
            if self.store is not None and self.records is not None:
                if conv is None:  # no record to say which files are its snapshots: every file of its branches
                    self.records.remove_branch_files(conversation_id)
                self.store.delete_record(conversation_id)
                self.records.remove_empty_folders(conversation_id)
            with self._lock:
                self._conversations.pop(conversation_id, None)
                self._sweep_due = True
                self.health.forget(conversation_id)
                self.last_used.pop(conversation_id, None)

    def _forget_turn(self, conv: Conversation, turn: Turn) -> None:
        """Delete the turn's snapshot, then forget the turn; under the conversation's lock (the
        manager's is taken after the store's answer)."""
        if turn.snapshot and self.persistent:
            self._delete_turn_file(conv.conversation_id, turn)
        with self._lock:
            self.warm.drop(conv.conversation_id, turn.ref)
            self.active.forget(conv.conversation_id, turn.ref)
            self._unsaved_by_health.discard((conv.conversation_id, turn.ref))
            self.quarantine.release(conv.conversation_id, turn.ref)
            del conv.turns[turn.ref]

    # ---- lifecycle -----------------------------------------------------------------------------

    def maintain(self) -> list[str]:
        """Demote by idle time: ACTIVE -> WARM (returns the engine slots to release), WARM -> COLD
        (the snapshot is written first unless the policy is manual_only), and expire conversations
        idle past the cold retention. Run periodically; the store is written and read outside the
        manager's lock."""
        now = self.clock()
        with self._lock:
            self.stats.demotions["active_to_warm"] += self.active.demote_idle(now - self.tiers.active_timeout)
            idle = [(cid, ref, self.warm.peek(cid, ref)) for cid, ref in self.warm.idle(now - self.tiers.warm_timeout) if cid not in self._busy]
        for cid, ref, state in idle:
            if state is not None and self._demote_to_cold(cid, ref, state):
                with self._lock:
                    self.warm.drop(cid, ref)
                    self._count("demotions", "warm_to_cold")
        if self.tiers.cold_retention > 0 and now >= self._next_expiry_scan:
            # Scanning every record on disk is the one costly step here: at most every minute.
            self._next_expiry_scan = now + min(60.0, self.tiers.cold_retention / 10)
            for cid in self.list_ids():
                if cid not in self._busy and now - self._last_use(cid) > self.tiers.cold_retention:
                    try:
                        self.delete_conversation(cid)
                    except UNUSABLE_CONVERSATION as e:
                        log.warning("not expiring conversation %r: %s", cid, e)
                        continue
                    with self._lock:
                        self.stats.expired_conversations += 1
        with self._lock:
            release = self.active.take_released()
            sweep = self.store is not None and self._sweep_due and now >= self._next_sweep
            if sweep:
                self._sweep_due, self._next_sweep = False, now + 60.0
        if sweep:
            self.sweep_store()
        return release

    def sweep_store(self) -> int:
        """Delete the store files that no snapshot of any conversation references (left by deleted
        turns and conversations, retention, or a crash), sparing those written in the last
        `orphan_grace_s` seconds. Returns how many went. A snapshot whose references cannot be read
        for now (an I/O error) stops the sweep: nothing is deleted that it might reference."""
        referenced: set[str] = set()
        for cid in self.list_ids():
            try:
                conv = self.get(cid)
            except UNUSABLE_CONVERSATION as e:
                log.warning("store sweep: %s", e)
                conv = None
            with self._lock:
                saved = [t for t in conv.turns.values() if t.snapshot] if conv is not None else []
            for t in saved:
                try:
                    stored = self._stored_of(cid, t)
                except SnapshotCorruptError as e:
                    if isinstance(e.__cause__, OSError):
                        log.warning("store sweep skipped: %s", e)
                        return 0
                    continue  # damaged: it cannot be loaded, what it names is no one's
                except SnapshotNotFoundError:
                    continue
                if stored is not None:
                    referenced |= stored.keys
        if self.prefix_disk is not None:
            referenced |= self.prefix_disk.referenced()
        try:
            removed = self._saved().store.sweep(referenced, self.orphan_grace_s)
        except OSError as e:  # an object store that failed midway: every delete done was justified on its own
            log.warning("store sweep stopped: %s", e)
            self._sweep_due = True
            return 0
        if removed:
            log.info("store sweep: %d unreferenced files removed", removed)
        return removed

    def _evicted(self, conversation_id: str, ref: str, state: SequenceState) -> None:
        """A state pushed out of the warm cache by pressure goes to disk, as an idle one does: it
        is set aside now (under the manager's lock) and written by `_write_leaving`."""
        self._count("demotions", "warm_evicted")
        self._leaving.append((conversation_id, ref, state))

    def _write_leaving(self) -> None:
        """Write the states pushed out of memory so far (behind, with async durability). The caller
        holds no lock: each write takes its own conversation's."""
        with self._lock:
            leaving, self._leaving = self._leaving, []
        for cid, ref, state in leaving:
            if self.writer is not None:
                self.writer.submit(functools.partial(self._demote_to_cold, cid, ref, state))
            else:
                self._demote_to_cold(cid, ref, state)

    def _written_on_leaving_memory(self, conversation_id: str, ref: str) -> bool:
        """Whether a state leaving memory is written first: with persistence, unless the policy is
        manual_only or the health policy kept it off disk."""
        return self.persistent and self.policy.trigger != SnapshotTrigger.MANUAL_ONLY and (conversation_id, ref) not in self._unsaved_by_health

    def _unwritten(self, conversation_id: str, ref: str) -> bool:
        """Whether a recorded turn lacks the snapshot its state gets on leaving memory."""
        conv = self._conversations.get(conversation_id)
        turn = conv.turns.get(ref) if conv is not None else None
        return turn is not None and not turn.snapshot and self._written_on_leaving_memory(conversation_id, ref)

    def _demote_to_cold(self, conversation_id: str, ref: str, state: SequenceState) -> bool:
        """Write the snapshot a state leaving the warm cache still lacks (`_written_on_leaving_memory`).
        False if the write fails. The caller holds no lock."""
        with self._held.hold(conversation_id):
            with self._lock:
                if not self._unwritten(conversation_id, ref):
                    return True
                conv = self._conversations[conversation_id]
                turn = conv.turns[ref]
            try:
                self._write_snapshot(conv, turn, state)
                self._persist_and_prune(conv, turn.branch)
            except (SnapshotError, OSError, StaleViewError) as e:  # StaleViewError: memory's copy is dropped, the store's read next
                turn.snapshot = False
                log.warning("snapshot of conversation %r turn %s leaving memory not written: %s", conversation_id, ref, e)
                return False
            return True

    def _last_use(self, conversation_id: str) -> float:
        if conversation_id in self.last_used:
            return self.last_used[conversation_id]
        written = self.records.modified(conversation_id) if self.records is not None else None
        return written if written is not None else self.clock()

    def preload(self, count: int) -> int:
        """Warm the latest snapshot of each branch of the `count` most recently used conversations."""
        if count <= 0 or self.records is None:
            return 0
        loaded = 0
        for cid in self.records.most_recent(count):
            try:
                conv = self.get(cid)
            except UNUSABLE_CONVERSATION as e:
                log.warning("preload skipped: %s", e)
                continue
            if conv is None:  # removed meanwhile
                continue
            for branch in conv.branches():
                turn = conv.latest(branch)
                if turn is not None and turn.snapshot:
                    try:
                        self.load_into_warm(conv.conversation_id, turn)
                        loaded += 1
                    except SnapshotError as e:
                        log.warning("preload skipped %s %s: %s", conv.conversation_id, turn.ref, e)
        return loaded

    def state_stats(self) -> dict[str, Any]:
        """Conversations and bytes per tier, tier hits, moves, latencies and health, as plain data."""
        with self._lock:
            st = self.stats
            snapshots = sum(t.snapshot for c in self._conversations.values() for t in c.turns.values())
            return {
                "tiers": {
                    "active": {"turns": len(self.active)},
                    "warm": {"states": len(self.warm), "bytes": self.warm.nbytes},
                    "cold": {"snapshots_known": snapshots, "conversations_loaded": len(self._conversations)},
                },
                "hits": dict(st.hits),
                "misses": st.misses,
                "promotions": dict(st.promotions),
                "demotions": dict(st.demotions),
                "expired_conversations": st.expired_conversations,
                "restore_seconds": {tier: h.summary() for tier, h in st.restore_seconds.items()},
                "snapshot_write_seconds": st.snapshot_write_seconds.summary(),
                "snapshot_write_failures": st.snapshot_write_failures,
                "store": asdict(self.store.stats) if self.store is not None else None,
                "prefix_cache": self._prefix_cache_stats(),
                "host_arena": self.host_arena.summary() if self.host_arena is not None else None,
                "health": asdict(self.health.stats),
                "quarantined": self.quarantine.list(),
            }

    def _prefix_cache_stats(self) -> dict[str, Any] | None:
        cache, disk = self.prefix_cache, self.prefix_disk
        if cache is None:
            return None
        return {"entries": len(cache), "bytes": cache.nbytes, **asdict(cache.stats), "disk": disk.summary() if disk is not None else None}

    def close(self, snapshot_budget_s: float = 0.0) -> None:
        """Graceful shutdown: finish every write still queued, then write the states only memory
        holds, as they would be on leaving it, for up to `snapshot_budget_s` seconds."""
        if self.writer is not None:
            self.writer.flush()
        self._write_unrecorded()
        self._write_unsaved(snapshot_budget_s)
        if self.writer is not None:
            self.writer.close()
        if self.prefix_disk is not None:
            self.prefix_disk.close()

    def _write_unrecorded(self) -> None:
        """Write the records that a failed write left behind memory (async durability)."""
        with self._lock:
            unrecorded = sorted(self._unrecorded & self._conversations.keys())  # not deleted meanwhile
        for cid in unrecorded:
            with self._held.hold(cid):
                conv = self._conversations.get(cid)
                try:
                    if conv is not None:
                        self._persist(conv)
                except OSError as e:
                    log.warning("shutdown: the record of conversation %r is still not written: %s", cid, e)

    def _write_unsaved(self, budget_s: float) -> None:
        """Write the snapshot every warm state still lacks (`_unwritten`), most recently used first."""
        deadline = time.monotonic() + budget_s
        with self._lock:
            unwritten = [(cid, ref, self.warm.peek(cid, ref)) for cid, ref in reversed(self.warm.idle(math.inf)) if self._unwritten(cid, ref)]
        written = 0
        for cid, ref, state in unwritten:
            if time.monotonic() >= deadline:
                break
            if state is not None:
                self._demote_to_cold(cid, ref, state)
            with self._lock:
                written += not self._unwritten(cid, ref)
        if unwritten:
            log.info(
                "shutdown: %d of %d states held only in memory written as snapshots (the rest: the shutdown budget "
                "ran out or the write failed; their turns are recomputed from their tokens)",
                written,
                len(unwritten),
            )

    # ---- export and import ----------------------------------------------------------------------

    def export_conversation(self, conversation_id: str, tenant: str | None, out: IO[bytes]) -> None:
        """Write the conversation as one file (state/exchange.py): its record, every snapshot and
        the store files they name."""
        saved = self._saved()
        with self._held.hold(conversation_id):
            export = export_of(self.require(conversation_id, tenant), saved)
        write_export(export, out)

    def import_conversation(self, src: IO[bytes], tenant: str | None, conversation_id: str | None = None) -> Conversation:
        """Add the conversation an export holds, as `conversation_id` (default: its own id),
        belonging to `tenant`. Every snapshot must load and verify here (this model, tokenizer,
        layout, dtypes, checksums); otherwise nothing of it is listed. An id in use is a conflict."""
        saved = self._saved()
        conv, snapshots = read_import(src, saved, tenant, conversation_id)
        cid = conv.conversation_id
        with self._held.hold(cid):
            existing = self.get(cid)
            with self._lock:
                if cid in self._busy or existing is not None:
                    raise ConversationConflictError(f"conversation {cid!r} exists already; import it under another conversation_id")
                self._busy[cid] = None
                self._conversations[cid] = conv
        written: list[tuple[str, str]] = []  # (location, ref)
        try:
            for t in (t for t in conv.turns.values() if t.snapshot):
                written.append((write_imported(saved, conv, t.ref, *snapshots[t.ref]), t.ref))
                self._load_turn(cid, t)  # checked like any snapshot; refused whole otherwise
            with self._held.hold(cid):
                self._persist(conv)
        except BaseException:
            with self._lock:
                self._conversations.pop(cid, None)
                self._sweep_due = True
            with self._held.hold(cid):
                for location, ref in written:
                    with contextlib.suppress(SnapshotNotFoundError):
                        saved.store.delete(location)
                    saved.forget(cid, ref)
            raise
        finally:
            self.release(cid)
        return conv


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit` (by halving slice comparisons,
    which run in C: every warm state is a candidate, with up to a whole history each)."""
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:  # a[:lo] == b[:lo]; the first difference, if any, is before hi
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
