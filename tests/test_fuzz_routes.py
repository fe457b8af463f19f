"""A bounded schemathesis run over every route of a real server: no answer >= 500, no crash.

Every operation in the server's /openapi.json is fuzzed, none excluded (FastAPI's own /openapi.json,
/docs and /redoc are not in the schema). The routes that mutate (DELETE of a conversation,
/flush_cache, /abort_request, /delete_snapshot) run on this throwaway server too. No API keys are
set. The cases are fixed by the seed; `scripts/fuzz_routes.py` runs the same harness for longer.
"""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from route_fuzz import MODEL, FuzzReport, fuzz_round, fuzz_server, operations

from engram.server.background import BackgroundServer

CASES_PER_KIND = 10  # about 430 cases in all, ~15 s on 2 cores
SEED = 29
SNAPSHOT_ROUTES = {
    "POST /save_snapshot",
    "POST /get_snapshot_info",
    "POST /restore_snapshot",
    "POST /delete_snapshot",
    "POST /list_snapshots",
    "GET /v1/conversations/{conversation_id}",
    "DELETE /v1/conversations/{conversation_id}",
}


def test_every_route_answers_fuzzed_requests_without_a_server_error(checkpoint_dir, tmp_path):
    report = FuzzReport()
    with fuzz_server(checkpoint_dir("nemotron"), str(tmp_path)) as server:
        routes = {op.label for op in operations(server.url)}
        fuzz_round(server.url, MODEL, CASES_PER_KIND, SEED, report)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    print(report.summary())
    assert not report.failures, "\n\n".join(f"{f.curl}\n-> {f.status} {f.response}\n{f.server_traceback}" for f in report.failures)
    assert set(report.cases) == routes  # every route was sent cases
    assert report.total >= 300
    answered = {route for (route, status), k in report.statuses.items() if status == 200}
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= answered
    # the cases find the shared conversations' snapshots, not only 404s and 422s
    assert SNAPSHOT_ROUTES <= answered, SNAPSHOT_ROUTES - answered


def test_the_harness_reports_a_server_error_with_its_traceback():
    app = FastAPI()

    @app.post("/boom")
    async def boom(body: dict) -> dict:
        raise RuntimeError("boom")

    report = FuzzReport()
    with BackgroundServer(app, wait_ready=False) as server:  # a bare app: nothing to warm up
        fuzz_round(server.url, MODEL, 3, SEED, report, conversations=())
    assert report.failures and all(f.status == 500 for f in report.failures)
    assert "RuntimeError: boom" in report.failures[0].server_traceback
    assert "/boom" in report.failures[0].curl
