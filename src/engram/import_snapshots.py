"""`engram import-snapshots DIR`: the predecessor's snapshots (state/predecessor.py) as this
engine's conversations, offline (no server).

Each saved turn's state is recomputed from the token ids it records, through the engine, from
the previous imported turn's state (exact by construction: restore equals recomputation), and
stored as a turn of the conversation in the snapshot store the server reads (`--snapshot-dir`).
Where the predecessor kept the recurrent state, it is compared with the recomputed one and the
largest difference reported; the recomputed state is the one stored either way. Importing again
adds nothing: a turn whose tokens a conversation already holds is reported unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engram.args import EngineArgs, ServerArgs, add_dataclass_args, from_namespace
from engram.state.predecessor import PredecessorTurn, RefusedFile, difference, recorded_state, scan
from engram.state.snapshot import SnapshotError
from engram.state.turns import Conversation, ConversationError, Turn, TurnPlan

if TYPE_CHECKING:
    from engram.engine.engine import LLMEngine
    from engram.state.conversations import ConversationManager
    from engram.state.sequence_state import SequenceState

# A recorded state differs when some tensor's largest difference exceeds this share of its largest
# magnitude: bf16 states and GPU kernels land within about 1e-2 of a float32 recomputation, a state
# of other tokens is off by the order of the values themselves.
DEFAULT_TOLERANCE = 0.05


@dataclass
class FileReport:
    file: str  # the predecessor's metadata file, relative to the imported folder
    status: str  # "imported", "unchanged" (imported before) or "refused"
    reason: str | None = None  # why it was refused
    conversation_id: str | None = None
    branch: str | None = None
    turn: int | None = None  # the turn number here
    predecessor_turn: int | None = None
    tokens: int | None = None
    recorded_state: bool = False  # whether the predecessor kept the recurrent state
    max_abs_diff: float | None = None  # recorded vs recomputed recurrent state
    max_rel_diff: float | None = None
    differs: bool | None = None  # max_rel_diff over the tolerance; None: nothing to compare
    snapshot: bool = True  # False: recorded without its snapshot (the health policy or a failed write), recomputed when next used

    def line(self) -> str:
        if self.status == "refused":
            return f"refused    {self.file}: {self.reason}"
        where = f"{self.conversation_id} {self.branch}/{self.turn:06d} ({self.tokens} tokens)"
        if self.status == "unchanged":
            check = "imported before"
        elif not self.recorded_state:
            check = "no recorded state to compare"
        else:
            verdict = "DIFFERS from" if self.differs else "matches"
            check = f"recorded state {verdict} the recomputed one: max |diff| {self.max_abs_diff:.3g}, relative {self.max_rel_diff:.3g}"
        stored = "" if self.snapshot else "; stored WITHOUT a snapshot (see the log): recomputed from its tokens when next used"
        return f"{self.status:<10} {self.file} -> {where}; {check}{stored}"


@dataclass
class ImportReport:
    source: str
    tolerance: float
    files: list[FileReport] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(f.status == status for f in self.files)

    @property
    def differing(self) -> int:
        return sum(bool(f.differs) for f in self.files)

    def summary(self) -> str:
        return (
            f"{self.count('imported')} imported ({self.differing} of them differ from the recorded state), "
            f"{self.count('unchanged')} unchanged, {self.count('refused')} refused"
        )

    def to_json(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "imported": self.count("imported"),
            "unchanged": self.count("unchanged"),
            "refused": self.count("refused"),
            "differing": self.differing,
        }


def import_snapshots(source: str | Path, engine: LLMEngine, manager: ConversationManager, tolerance: float = DEFAULT_TOLERANCE) -> ImportReport:
    """Import every turn file under `source` into `manager`'s conversations, computing states with
    `engine` (whose model the files must be of); what was imported, unchanged or refused, per file."""
    root = Path(source)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder")
    found = scan(root, engine.spec)
    report = ImportReport(str(root), tolerance)
    report.files += [FileReport(label, "refused", reason) for label, reason in found.refused.items()]
    requests = itertools.count()
    for turn in found.turns:  # main turns before branches, each in turn order
        try:
            report.files.append(_import_turn(turn, engine, manager, tolerance, lambda: f"import-{next(requests)}"))
        except RefusedFile as e:
            report.files.append(
                FileReport(turn.label, "refused", str(e), turn.conversation_id, turn.branch or "main", predecessor_turn=turn.turn_number)
            )
    report.files.sort(key=lambda f: f.file)
    return report


def _import_turn(
    found: PredecessorTurn, engine: LLMEngine, manager: ConversationManager, tolerance: float, request_id: Callable[[], str]
) -> FileReport:
    cid, branch, tokens = found.conversation_id, found.branch or "main", found.fill_ids
    report = FileReport(
        found.label,
        "imported",
        conversation_id=cid,
        branch=branch,
        predecessor_turn=found.turn_number,
        tokens=len(tokens),
        recorded_state=found.state_path is not None,
    )
    try:
        conv = manager.get(cid)
        done = _holding(conv, branch, tokens) if conv is not None else None
        if done is not None:
            report.status, report.turn = "unchanged", done.turn
            return report
        recorded = recorded_state(found, engine.spec) if found.state_path is not None else None  # before the reservation
        from_turn = _base(conv, branch, tokens) if conv is not None else None
        plan = manager.begin(cid, branch, from_turn=from_turn)
    except (ConversationError, SnapshotError) as e:
        raise RefusedFile(str(e)) from e
    try:
        if not isinstance(plan, TurnPlan):  # a turn made by an idempotency key: none is passed
            raise RefusedFile(f"conversation {cid!r} answered with an earlier turn")
        if plan.history_tokens != tokens[: len(plan.history_tokens)]:
            raise RefusedFile(f"its token ids do not extend those of turn {plan.parent} of the conversation")
        if plan.resume_key is not None:  # the manager's ACTIVE tier names a slot this command never keeps: fetch the state
            manager.fall_back(plan)
        state = _recompute(engine, tokens, plan.state, request_id())
    except BaseException:
        manager.release(cid)
        raise
    if recorded is not None:
        gap = difference(recorded, state.flat_tensors())
        report.max_abs_diff, report.max_rel_diff, report.differs = gap.max_abs, gap.max_rel, not gap.within(tolerance)
    turn = manager.finish(plan, tokens, [], [], state)
    report.turn, report.snapshot = turn.turn, turn.snapshot
    return report


def _holding(conv: Conversation, branch: str, tokens: list[int]) -> Turn | None:
    """The turn of `branch` (its own or an ancestor) whose history is exactly `tokens`."""
    return next((t for t in conv.chain(conv.latest(branch) or conv.latest("main")) if conv.tokens(t) == tokens), None)


def _base(conv: Conversation, branch: str, tokens: list[int]) -> int | None:
    """The turn a new branch starts from: the latest of main's turns whose history `tokens` begins with."""
    if branch == "main" or conv.latest(branch) is not None or not conv.turns:
        return None
    prefixes = [t for t in conv.chain(conv.latest("main")) if tokens[: len(conv.tokens(t))] == conv.tokens(t)]
    if not prefixes:
        raise RefusedFile(f"branch {branch!r}: its token ids begin with the history of none of main's turns")
    return prefixes[-1].turn


def _recompute(engine: LLMEngine, tokens: list[int], initial: SequenceState | None, request_id: str) -> SequenceState:
    """The state after `tokens`, computing only those past `initial`."""
    from engram.engine.request import SamplingParams

    try:
        engine.add_request(request_id, tokens, SamplingParams(max_tokens=0), initial_state=initial, capture_state=True)
    except ValueError as e:  # too long for the context, or otherwise not a request this engine takes
        raise RefusedFile(str(e)) from e
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == request_id and o.finished), final)
    if final is None or final.state is None:
        raise RefusedFile("the engine returned no state for its token ids")
    return final.state.wait()


def add_import_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="DIR", help="the predecessor's snapshot folder (its --snapshot-dir)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH ('-': standard output)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="largest difference, relative to each tensor's largest magnitude, at which a recorded state "
        f"still matches the recomputed one (default {DEFAULT_TOLERANCE})",
    )
    add_dataclass_args(parser, EngineArgs)
    add_dataclass_args(parser, ServerArgs)


def run(ns: argparse.Namespace) -> int:
    """Exit status 1 when a file was refused."""
    from engram.engine.engine import LLMEngine
    from engram.server.conversations import build_manager

    engine_args = from_namespace(EngineArgs, ns)
    if engine_args.model_path is None:
        raise SystemExit("engram import-snapshots: --model-path is required (the model the snapshots were made with)")
    # Every imported turn is written to disk before the command ends, whatever the server's policy.
    server_args = dataclasses.replace(
        from_namespace(ServerArgs, ns), enable_snapshot_persistence=True, snapshot_trigger_policy="every_turn", snapshot_durability="sync"
    )
    engine = LLMEngine(engine_args)
    manager = build_manager(engine, server_args)
    try:
        report = import_snapshots(ns.source, engine, manager, ns.tolerance)
    finally:
        manager.close()
    lines = sys.stderr if ns.json == "-" else sys.stdout  # standard output is the JSON's then
    for f in report.files:
        print(f.line(), file=lines)
    print(report.summary(), file=lines)
    if ns.json == "-":
        json.dump(report.to_json(), sys.stdout, indent=2)
    elif ns.json:
        Path(ns.json).write_text(json.dumps(report.to_json(), indent=2))
    return 1 if report.count("refused") else 0
