"""Moving one conversation between servers: `GET /v1/conversations/{id}/export` answers one file
(state/transfer.py), `POST /v1/conversations/import` takes it back (the raw file as the body, up
to `--max-import-bytes`). The caller's tenant owns what it imports and exports only its own."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from engram.server.auth import caller_of
from engram.server.serving import get_serving

router = APIRouter()
IMPORT_PATH = "/v1/conversations/import"
READ_SIZE = 1 << 20


@router.get("/v1/conversations/{conversation_id}/export")
async def export_conversation(conversation_id: str, raw_request: Request) -> StreamingResponse:
    manager = get_serving(raw_request).conversations.manager
    spool = tempfile.TemporaryFile()
    try:
        await asyncio.to_thread(manager.export_conversation, conversation_id, caller_of(raw_request).restricted_to, spool)
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    headers = {"Content-Disposition": f'attachment; filename="{conversation_id}.engram.tar"'}
    return StreamingResponse(_chunks(spool), media_type="application/x-tar", headers=headers)


def _chunks(spool: IO[bytes]) -> Iterator[bytes]:
    with spool:
        while data := spool.read(READ_SIZE):
            yield data


@router.post(IMPORT_PATH)
async def import_conversation(raw_request: Request, conversation_id: str | None = Query(default=None)) -> dict[str, Any]:
    """The body is an export; `conversation_id` names the imported conversation (default: its own id)."""
    manager = get_serving(raw_request).conversations.manager
    with tempfile.TemporaryFile() as spool:
        async for data in raw_request.stream():
            spool.write(data)
        spool.seek(0)
        conv = await asyncio.to_thread(manager.import_conversation, spool, caller_of(raw_request).restricted_to, conversation_id)
    return {
        "id": conv.conversation_id,
        "object": "conversation",
        "owner": conv.owner,
        "latest_turns": {branch: head.turn for branch, head in conv.heads().items()},
        "snapshots": sum(t.snapshot for t in conv.turns.values()),
    }
