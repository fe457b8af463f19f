"""Schemathesis over every route of a running server, from its own OpenAPI schema.

Each operation gets cases of three kinds: schemathesis' positive ones (what the schema allows)
and negative ones (what it does not), and, for the routes with a body, `fuzz_bodies`' valid
ones (past the checks the schema cannot state, so they reach the engine and the conversation
store). A positive case may be steered towards the server's state: the served model's name in
`model`, `conversation_id` one of a few shared ids. Before each operation the shared
conversations are made again where a case deleted them (two turns each, so each has snapshots),
so that the snapshot and conversation routes also get cases that find what they name. Every
response is checked with schemathesis' `not_a_server_error`; a request that gets no answer is a
failure too.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import hypothesis
import requests
import schemathesis
from fuzz_bodies import BODIES, CONVERSATIONS
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup
from schemathesis.schemas import APIOperation

from engram.args import EngineArgs, ServerArgs
from engram.launch_server import build_app
from engram.server.background import BackgroundServer

REQUEST_TIMEOUT_S = 60.0
TRACEBACK_WAIT_S = 1.0
KINDS = ("positive", "negative", "valid")
MODEL = "m"
# A chat request without max_tokens generates to the end of the context (and may ask for 64
# choices): a short context keeps every case short.
CONTEXT_LENGTH = 192


@contextmanager
def fuzz_server(model_path: str, snapshot_dir: str) -> Iterator[BackgroundServer]:
    """A server of `model_path` serving it as MODEL, with a short context and no API keys."""
    engine_args = EngineArgs(model_path=str(model_path), max_running_requests=8, max_total_tokens=4096, context_length=CONTEXT_LENGTH)
    with BackgroundServer(build_app(engine_args, ServerArgs(served_model_name=MODEL, snapshot_dir=snapshot_dir))) as server:
        yield server


@dataclass
class Failure:
    """A case answered with a 5xx (or not at all): how to send it again, and what the server said."""

    route: str
    status: int | None
    curl: str
    response: str
    server_traceback: str


@dataclass
class FuzzReport:
    cases: Counter[str] = field(default_factory=Counter)  # route -> cases sent
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)  # (route, status) -> responses
    failures: list[Failure] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.cases.values())

    def summary(self) -> str:
        """One line per route: its cases and the statuses they got."""
        lines = [f"{self.total} cases, {len(self.failures)} failures (5xx or no answer)"]
        for route, n in sorted(self.cases.items()):
            got = ", ".join(f"{status}: {k}" for (r, status), k in sorted(self.statuses.items()) if r == route)
            lines.append(f"  {route:45} {n:7}  {got}")
        return "\n".join(lines)


class _TracebackRecorder(logging.Handler):
    """Keeps the tracebacks the server logs (uvicorn and the app log an unhandled exception)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.tracebacks: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.tracebacks.append("".join(traceback.format_exception(*record.exc_info)))

    def since(self, seen: int, wait_s: float = TRACEBACK_WAIT_S) -> str:
        """The tracebacks logged after the first `seen`, waiting a little for one: the server logs
        an unhandled exception after it has sent its 500."""
        deadline = time.monotonic() + wait_s
        while len(self.tracebacks) <= seen and time.monotonic() < deadline:
            time.sleep(0.01)
        return "\n".join(self.tracebacks[seen:])


@contextmanager
def server_tracebacks() -> Iterator[_TracebackRecorder]:
    """Record what an in-process server logs with a traceback, while the block runs (uvicorn's
    loggers do not propagate to the root one)."""
    recorder = _TracebackRecorder()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(recorder)
    try:
        yield recorder
    finally:
        for logger in loggers:
            logger.removeHandler(recorder)


def operations(base_url: str) -> list[APIOperation]:
    """Every operation of the server's OpenAPI schema (none left out)."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _steer(case: Case, model: str | None, conversation: str | None) -> Case:
    """Point a case at the server's model and at one of the shared conversations (a None leaves it)."""
    if isinstance(case.body, dict):
        if model is not None and "model" in case.body:
            case.body["model"] = model
        if conversation is not None and "conversation_id" in case.body:
            case.body["conversation_id"] = conversation
    if conversation is not None and "conversation_id" in case.path_parameters:
        case.path_parameters["conversation_id"] = conversation
    return case


def case_strategy(operation: APIOperation, kind: str, model: str) -> st.SearchStrategy[Case] | None:
    """The cases of one kind for an operation; None where it has none of that kind."""
    if kind == "negative":
        return operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)
    if kind == "positive":
        cases = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
        return st.builds(_steer, cases, st.sampled_from((None, model)), st.sampled_from((None, *CONVERSATIONS)))
    bodies = BODIES.get(operation.label)
    return None if bodies is None else bodies(model).map(lambda body: operation.Case(body=body, media_type="application/json"))


def _send(case: Case, base_url: str, recorder: _TracebackRecorder, report: FuzzReport) -> None:
    route = case.operation.label
    report.cases[route] += 1
    seen = len(recorder.tracebacks)
    try:
        response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
    except requests.RequestException as e:
        report.failures.append(Failure(route, None, case.as_curl_command(base_url=base_url), repr(e), ""))
        return
    report.statuses[route, response.status_code] += 1
    try:
        case.validate_response(response, checks=[not_a_server_error])
    except FailureGroup:
        curl = case.as_curl_command(base_url=base_url)
        report.failures.append(Failure(route, response.status_code, curl, response.text, recorder.since(seen)))


def fuzz_operation(
    operation: APIOperation, kind: str, *, base_url: str, model: str, cases: int, seed: int, recorder: _TracebackRecorder, report: FuzzReport
) -> None:
    """Send up to `cases` cases of one kind to one operation (fewer where its inputs run out)."""
    strategy = case_strategy(operation, kind, model)
    if strategy is None:
        return

    @settings(
        max_examples=cases,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=hypothesis.Verbosity.quiet,
    )
    @hypothesis.seed(seed)
    @hypothesis.given(strategy)
    def run(case: Case) -> None:
        _send(case, base_url, recorder, report)

    try:
        run()
    except Unsatisfiable:  # no negative case exists for an operation without inputs
        pass


def ensure_conversations(base_url: str, model: str, conversations: Sequence[str]) -> None:
    """Make each of `conversations` that is gone (a case deleted it, or it never was) again: two
    short turns, each with a snapshot."""
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
        for conversation_id in conversations:
            if http.get(f"/v1/conversations/{conversation_id}").status_code == 200:
                continue
            for text in ("one", "two"):
                body = {
                    "model": model,
                    "conversation_id": conversation_id,
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": 2,
                    "temperature": 0,
                }
                http.post("/v1/chat/completions", json=body).raise_for_status()


def fuzz_round(base_url: str, model: str, cases_per_kind: int, seed: int, report: FuzzReport, conversations: Sequence[str] = CONVERSATIONS) -> None:
    """One pass over every operation, each kind of case capped at `cases_per_kind`; the shared
    `conversations` exist when each operation's cases start."""
    with server_tracebacks() as recorder:
        for operation in operations(base_url):
            ensure_conversations(base_url, model, conversations)
            for kind in KINDS:
                fuzz_operation(operation, kind, base_url=base_url, model=model, cases=cases_per_kind, seed=seed, recorder=recorder, report=report)
