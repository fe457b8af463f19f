"""kill -9 a loaded server again and again; then check that nothing answered was lost.

    python scripts/crash_test.py [--clients 8] [--turns 200] [--kills 10]

Serves a tiny random checkpoint with `python -m engram serve --snapshot-durability sync`.
`--clients` threads hold conversation turns (greedy, a few tokens; every other client streams),
each client moving to a new conversation every few turns, while the server is killed with
SIGKILL `--kills` times at random moments and restarted on the same snapshot folder. A turn is
answered when its client got a 200 with a turn number or, streamed, the chunk with the finish
reason ([DONE] after it or not). After the load the server is killed once more, idle, and
restarted, and then:

  (a) every answered turn is in GET /v1/conversations/{id}, with the reply its client got;
  (c) every conversation the server has continues exactly: the next turn keeps the history's
      token ids, resumes from the stored state (cached tokens == state_len) and its reply equals
      /generate's over the full token history plus the new prompt (greedy). The stored state is
      the latest turn's snapshot or, where that turn has none (it finished without a captured
      state, preempted at its end: its record's state_len is 0; or its snapshot write failed,
      logged in server.log), the nearest earlier turn's; how many resumed from an earlier one is counted. A conversation none of whose
      attempts was answered (each cut by a kill) may have no turn to continue: counted, and (a)
      checks that none was answered;
  (b) every snapshot /list_snapshots lists restores (/restore_snapshot): none corrupt.

Prints a summary; exits 1 on any answered turn lost, corrupt snapshot or inexact continuation.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from checkpoints import write_checkpoint
from server_utils import ServerProcess
from test_crash_recovery import MODEL, serve_args

MAX_TOKENS = 8
TURNS_PER_CONVERSATION = 6  # keeps every history far below the context length
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Answer:
    conversation_id: str
    turn: int
    text: str
    streamed: bool
    done: bool  # a stream's [DONE] came after the finish chunk (always True unstreamed)


@dataclass
class Tally:
    """What the clients got, shared between their threads."""

    answers: list[Answer] = field(default_factory=list)
    unanswered: Counter[str] = field(default_factory=Counter)  # reason -> attempts
    conversations: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, conversation_id: str, outcome: Answer | str) -> None:
        with self.lock:
            self.conversations.add(conversation_id)
            if isinstance(outcome, Answer):
                self.answers.append(outcome)
            else:
                self.unanswered[outcome] += 1

    @property
    def answered(self) -> int:
        with self.lock:
            return len(self.answers)


def _chat_body(conversation_id: str, text: str, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "conversation_id": conversation_id,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    }


def chat_turn(http: httpx.Client, conversation_id: str, text: str) -> Answer | str:
    """One non-streamed turn: its answer, or why there was none."""
    r = http.post("/v1/chat/completions", json=_chat_body(conversation_id, text, False))
    if r.status_code != 200:
        return f"status {r.status_code}"
    body = r.json()
    return Answer(conversation_id, body["turn"], body["choices"][0]["message"]["content"], streamed=False, done=True)


def streamed_turn(http: httpx.Client, conversation_id: str, text: str) -> Answer | str:
    """One streamed turn: answered once the finish chunk came, [DONE] or not."""
    parts: list[str] = []
    finished: dict[str, Any] | None = None
    with http.stream("POST", "/v1/chat/completions", json=_chat_body(conversation_id, text, True)) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        try:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    return _stream_answer(conversation_id, finished, parts, done=True) or "stream: [DONE] without a finish chunk"
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return "stream: error in band"
                    parts += [c["delta"].get("content") or "" for c in chunk["choices"]]
                    if any(c.get("finish_reason") for c in chunk["choices"]):
                        finished = chunk
        except httpx.HTTPError:
            pass
    return _stream_answer(conversation_id, finished, parts, done=False) or "stream: cut before the finish chunk"


def _stream_answer(conversation_id: str, finished: dict[str, Any] | None, parts: list[str], done: bool) -> Answer | None:
    return None if finished is None else Answer(conversation_id, finished["turn"], "".join(parts), streamed=True, done=done)


def client(index: int, server: ServerProcess, tally: Tally, stop: threading.Event) -> None:
    """Hold turns until told to stop; a new conversation every few turns or after a refusal."""
    turn = streamed_turn if index % 2 == 1 else chat_turn
    n_conversation, turns_here, attempt = 0, 0, 0
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        while not stop.is_set():
            conversation_id = f"crash-{index}-{n_conversation}"
            attempt += 1
            try:
                outcome = turn(http, conversation_id, f"client {index} message {attempt}")
            except httpx.ConnectError:  # the server is down: nothing was sent
                time.sleep(0.1)
                continue
            except httpx.HTTPError as e:
                outcome = f"connection lost ({type(e).__name__})"
            tally.add(conversation_id, outcome)
            turns_here += 1
            if turns_here >= TURNS_PER_CONVERSATION or (isinstance(outcome, str) and outcome.startswith("status")):
                n_conversation, turns_here = n_conversation + 1, 0


def run_load(server: ServerProcess, clients: int, turns: int, kills: int, rng: random.Random) -> Tally:
    """Clients hold turns; the server is killed after each share of `turns` (a random moment
    later) and restarted, `kills` times; the load stops once `turns` turns were answered."""
    tally, stop = Tally(), threading.Event()
    threads = [threading.Thread(target=client, args=(i, server, tally, stop), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    share, start = -(-turns // (kills + 1)), time.monotonic()
    for k in range(kills):
        _wait_for(lambda k=k: tally.answered >= (k + 1) * share)
        time.sleep(rng.uniform(0.0, 1.0))
        server.kill()
        print(f"kill {k + 1} at {time.monotonic() - start:.0f} s: {tally.answered} turns answered so far", flush=True)
        server.start()
    _wait_for(lambda: tally.answered >= turns)
    stop.set()
    for t in threads:
        t.join()
    print(f"load done at {time.monotonic() - start:.0f} s", flush=True)
    return tally


def _wait_for(condition, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the load made no progress")
        time.sleep(0.05)


def lost_answers(http: httpx.Client, answers: list[Answer]) -> dict[Answer, str]:
    """The answered turns the server no longer has, or has with another reply (and which)."""
    lost = {}
    for conversation_id in sorted({a.conversation_id for a in answers}):
        r = http.get(f"/v1/conversations/{conversation_id}")
        main = r.json()["branches"].get("main", {}) if r.status_code == 200 else {}
        replies = [m["content"] for m in main.get("messages", []) if m["role"] == "assistant"]
        for a in (a for a in answers if a.conversation_id == conversation_id):
            if len(replies) < a.turn:
                lost[a] = f"missing: the conversation has {len(replies)} turns"
            elif replies[a.turn - 1] != a.text:
                lost[a] = f"another reply: {replies[a.turn - 1]!r}"
    return lost


@dataclass(frozen=True)
class Resume:
    """Where a conversation's next turn resumes: the latest turn's snapshot or, where that turn has
    none, the nearest earlier one's (recomputing the rest)."""

    latest_turn: int
    from_turn: int  # 0: no turn of the chain has a snapshot, the whole history is recomputed
    state_len: int  # of from_turn's state
    token_count: int  # of the whole history
    why_earlier: str | None  # why the latest turn has no snapshot (None: it has one)


def resume_point(http: httpx.Client, conversation_id: str) -> Resume | None:
    """From the record (GET /v1/conversations); None if the server has no turn of it."""
    r = http.get(f"/v1/conversations/{conversation_id}")
    if r.status_code == 404:
        return None
    record = r.json()
    main = record["branches"]["main"]
    turns = {t["turn"]: t for t in record["turns"] if t["branch"] == "main"}
    latest = turns[main["latest_turn"]]
    saved = [t for n, t in sorted(turns.items()) if t["snapshot"]]
    why = None
    if not latest["snapshot"]:  # state_len 0: the turn finished without a captured state (preempted at its end)
        why = "recorded without a captured state" if latest["state_len"] == 0 else "its snapshot was not written"
    start = saved[-1] if saved else {"turn": 0, "state_len": 0}
    return Resume(latest["turn"], start["turn"], start["state_len"], main["token_count"], why)


def continues_exactly(http: httpx.Client, conversation_id: str, resume: Resume) -> str | None:
    """None if the conversation's next turn is exact, else what differed: the next turn keeps the
    history (its prompt extends the tokens of the state it resumes from and is longer than the
    history), resumes from that state (cached tokens == its state_len) and its reply equals
    /generate's over the same prompt."""
    before = None
    if resume.from_turn:
        r = http.post("/get_snapshot_info", json={"conversation_id": conversation_id, "turn_number": resume.from_turn})
        if r.status_code != 200:
            return f"snapshot of turn {resume.from_turn}: {r.status_code} {r.text[:200]}"
        before = r.json()
    r = http.post("/v1/chat/completions", json=_chat_body(conversation_id, "after the crashes", False))
    if r.status_code != 200:
        return f"next turn: {r.status_code} {r.text[:200]}"
    reply = r.json()
    r = http.post("/get_snapshot_info", json={"conversation_id": conversation_id, "turn_number": reply["turn"]})
    if r.status_code != 200:
        return f"snapshot of the next turn: {r.status_code} {r.text[:200]}"
    fill = r.json()["fill_ids"]
    prompt = fill[: len(fill) - reply["usage"]["completion_tokens"]]
    if before is not None and prompt[: len(before["fill_ids"])] != before["fill_ids"] or len(prompt) <= resume.token_count:
        return "the next turn's prompt does not extend the history's tokens"
    if reply["usage"]["prompt_tokens_details"]["cached_tokens"] != resume.state_len:
        return f"the next turn resumed from {reply['usage']['prompt_tokens_details']['cached_tokens']} cached tokens, not {resume.state_len}"
    full = http.post("/generate", json={"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS}}).json()
    if full["output_ids"] != fill[len(prompt) :] or full["text"] != reply["choices"][0]["message"]["content"]:
        return "the reply differs from /generate over the full history"
    return None


def unloadable_snapshots(http: httpx.Client) -> tuple[int, list[str]]:
    """(snapshots listed, those that did not restore or are quarantined, with why)."""
    listed = http.post("/list_snapshots", json={}).json()["snapshots"]
    bad = []
    for snap in listed:
        where = f"{snap['conversation_id']}/{snap['snapshot_id']}"
        if snap["quarantined"]:
            bad.append(f"{where}: quarantined ({snap['quarantine_reason']})")
            continue
        r = http.post(
            "/restore_snapshot",
            json={"conversation_id": snap["conversation_id"], "turn_number": snap["turn_number"], "branch_name": snap["branch_name"]},
        )
        if r.status_code != 200:
            bad.append(f"{where}: {r.status_code} {r.text[:200]}")
    return len(listed), bad


@dataclass
class Results:
    tally: Tally
    kills: int
    lost: dict[Answer, str]
    resumes: dict[str, Resume | None]  # None: the server has no turn of it
    inexact: dict[str, str]
    snapshots: int
    unloadable: list[str]

    def failed(self) -> bool:
        return bool(self.lost or self.inexact or self.unloadable)

    def table(self) -> str:
        rows = [("", "answered", "lost")]
        for streamed, name in ((False, "non-streamed turns"), (True, "streamed turns")):
            rows.append((name, sum(a.streamed == streamed for a in self.tally.answers), sum(a.streamed == streamed for a in self.lost)))
        no_done = [a for a in self.tally.answers if not a.done]
        rows.append(("  streamed, finish chunk but no [DONE]", len(no_done), sum(a in no_done for a in self.lost)))
        lines = [f"{name:40} {answered:>8} {lost:>6}" for name, answered, lost in rows]
        lines.append(f"kills -9 under load: {self.kills} (and one idle before the checks)")
        lines.append("unanswered attempts: " + (", ".join(f"{why}: {n}" for why, n in self.tally.unanswered.most_common()) or "none"))
        lines.append(f"snapshots listed: {self.snapshots}, not restorable: {len(self.unloadable)}")
        held = {c: r for c, r in self.resumes.items() if r is not None}
        lines.append(
            f"conversations tried: {len(self.resumes)}, with no turn recorded (none of their attempts answered): {len(self.resumes) - len(held)}"
        )
        lines.append(f"conversations continued: {len(held)}, exactly: {len(held) - len(self.inexact)}")
        earlier = Counter(r.why_earlier for r in held.values() if r.why_earlier)
        lines.append(
            "  resumed from an earlier turn's snapshot, the latest turn "
            + (", ".join(f"{why}: {n}" for why, n in earlier.items()) if earlier else "having one in every conversation")
        )
        lines += [f"    {c}: turn {r.latest_turn} {r.why_earlier}, resumed from turn {r.from_turn}" for c, r in held.items() if r.why_earlier]
        lines += [f"  LOST {a}: {why}" for a, why in self.lost.items()] + [f"  INEXACT {c}: {why}" for c, why in self.inexact.items()]
        lines += [f"  NOT RESTORABLE {why}" for why in self.unloadable]
        return "\n".join(lines)


def check(server: ServerProcess, tally: Tally, kills: int) -> Results:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        lost = lost_answers(http, tally.answers)
        resumes = {c: resume_point(http, c) for c in sorted(tally.conversations)}
        inexact = {c: why for c, r in resumes.items() if r is not None and (why := continues_exactly(http, c, r)) is not None}
        snapshots, unloadable = unloadable_snapshots(http)
    return Results(tally, kills, lost, resumes, inexact, snapshots, unloadable)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=200, help="answered turns to reach before the checks")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    parser.add_argument("--checkpoint", default="nemotron", help="kind of tiny random checkpoint (tests/checkpoints.py)")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="keep the checkpoint, the snapshot folder and server.log (every start's output) here; default: a temporary folder, removed",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_path = write_checkpoint(args.checkpoint, work / "model")
        server = ServerProcess(serve_args(model_path, work / "snapshots"), work / "server.log")
        server.start()
        try:
            tally = run_load(server, args.clients, args.turns, args.kills, random.Random(args.seed))
            server.kill()
            server.start()
            results = check(server, tally, args.kills)
        finally:
            server.kill()
    print(results.table())
    return 1 if results.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
