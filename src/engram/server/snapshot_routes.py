"""Snapshot routes with the request bodies of the SGLang-based predecessor (`/save_snapshot`,
`/list_snapshots`, `/get_snapshot_info`, `/restore_snapshot`, `/delete_snapshot`), and
`/v1/conversations`. Status codes are honest: 404 not found, 409 busy or unusable,
422 invalid; every answer keeps the predecessor's `success` field. A tenant (see `auth`) reaches
only its own conversations: another's is not found, on every route."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from engram.server import native_routes
from engram.server.auth import caller_of
from engram.server.errors import SNAPSHOT_TAG, APIError
from engram.server.protocol import (
    ListSnapshotsRequest,
    RestoreSnapshotRequest,
    SaveSnapshotRequest,
    SnapshotSelector,
)
from engram.server.serving import Serving, collect, engine_request_id, get_serving
from engram.server.streaming import cancel_on_disconnect, sse_response
from engram.state.conversations import ConversationManager
from engram.state.snapshot import snapshot_label, validate_id
from engram.state.turns import Conversation, ConversationRecordError, Turn

admin_router = APIRouter(tags=[SNAPSHOT_TAG])  # guarded by --admin-api-key
router = APIRouter()


def _turn_of(s: Serving, selector: SnapshotSelector, raw_request: Request) -> tuple[Conversation, Turn]:
    manager = s.conversations.manager
    conv = manager.require(selector.conversation_id, caller_of(raw_request).restricted_to)
    branch, turn = selector.target()
    head = conv.heads().get(validate_id(branch, "branch"))
    if head is None:
        raise APIError(404, f"conversation {selector.conversation_id!r} has no branch {branch!r}")
    return conv, head if turn is None else manager.find_turn(conv, branch, turn)


def _visible(manager: ConversationManager, conversation_id: str, tenant: str | None) -> bool:
    try:
        conv = manager.get(conversation_id)
    except ConversationRecordError:
        return tenant is None
    return conv is not None and conv.visible_to(tenant)


def _snapshot_entry(manifest: dict[str, Any], tokens: list[int], quarantine: dict[str, Any] | None, model_name: str) -> dict[str, Any]:
    """`timestamp` and `model_name` are the predecessor's names (its clients read them)."""
    return {
        "quarantined": quarantine is not None,
        "quarantine_reason": quarantine["reason"] if quarantine else None,
        "conversation_id": manifest["conversation_id"],
        "branch_name": manifest["branch"],
        "turn_number": manifest["turn"],
        "snapshot_id": f"{manifest['branch']}/{manifest['turn']:06d}",
        "state_len": manifest["state_len"],
        "token_count": manifest.get("token_count"),
        "created_at": manifest.get("created_at"),
        "timestamp": manifest.get("created_at"),
        "model_name": model_name,
        "manifest": {**manifest, "path": snapshot_label(manifest["path"])},  # below the snapshot folder: no server path
        "fill_ids": tokens,
    }


def _entry(s: Serving, manifest: dict[str, Any]) -> dict[str, Any]:
    manager = s.conversations.manager
    ref = f"{manifest['branch']}/{manifest['turn']:06d}"
    held = [q for q in manager.quarantine.list(manifest["conversation_id"]) if q["ref"] == ref]
    return _snapshot_entry(manifest, manager.snapshot_tokens(manifest), held[0] if held else None, s.model_name)


@admin_router.post("/save_snapshot")
async def save_snapshot(body: SaveSnapshotRequest, raw_request: Request) -> dict[str, Any]:
    """Snapshot a turn whose state is still held: by conversation (latest turn when no selector)
    or by the `rid` of the chat request that made it."""
    s = get_serving(raw_request)
    if body.conversation_id is not None:
        conversation_id, (branch, turn) = body.conversation_id, body.target()
    elif body.rid is not None and body.rid in s.conversations.by_request:
        conversation_id, branch, turn = s.conversations.by_request[body.rid]
    else:  # the protocol refuses a request with neither
        raise APIError(404, f"no finished conversation turn was made by request {body.rid!r}")
    await asyncio.to_thread(s.conversations.manager.require, conversation_id, caller_of(raw_request).restricted_to)
    saved = await asyncio.to_thread(s.conversations.manager.save, conversation_id, branch, turn)
    return {
        "success": True,
        "conversation_id": conversation_id,
        "branch_name": saved.branch,
        "turn_number": saved.turn,
        "snapshot_id": saved.ref,
        "message": f"snapshot of turn {saved.ref} saved",
    }


@admin_router.post("/list_snapshots")
async def list_snapshots(body: ListSnapshotsRequest, raw_request: Request) -> dict[str, Any]:
    s = get_serving(raw_request)
    manager = s.conversations.manager
    tenant = caller_of(raw_request).restricted_to
    if body.conversation_id is not None:
        await asyncio.to_thread(manager.require, body.conversation_id, tenant)
    entries = await asyncio.to_thread(manager.snapshots, body.conversation_id)

    def listed() -> list[dict[str, Any]]:  # records and manifests are read from the store: off the event loop
        shown = (
            entries if tenant is None or body.conversation_id is not None else [m for m in entries if _visible(manager, m["conversation_id"], tenant)]
        )
        return [_entry(s, m) for m in shown]

    return {"success": True, "snapshots": await asyncio.to_thread(listed)}


@admin_router.post("/get_snapshot_info")
async def get_snapshot_info(body: SnapshotSelector, raw_request: Request) -> dict[str, Any]:
    s = get_serving(raw_request)
    _, turn = await asyncio.to_thread(_turn_of, s, body, raw_request)
    manager = s.conversations.manager
    manifest = await asyncio.to_thread(manager.snapshot_manifest, body.conversation_id, turn)
    return {"success": True, **await asyncio.to_thread(_entry, s, manifest)}


@admin_router.post("/delete_snapshot")
async def delete_snapshot(body: SnapshotSelector, raw_request: Request) -> dict[str, Any]:
    s = get_serving(raw_request)
    _, turn = await asyncio.to_thread(_turn_of, s, body, raw_request)
    await asyncio.to_thread(s.conversations.manager.delete_snapshot, body.conversation_id, turn.branch, turn.turn)
    return {"success": True, "message": f"snapshot of turn {turn.ref} deleted"}


@admin_router.post("/restore_snapshot", response_model=None)
@cancel_on_disconnect
async def restore_snapshot(body: RestoreSnapshotRequest, raw_request: Request) -> StreamingResponse | dict[str, Any]:
    """Restore-only (load, verify, keep the state warm; with `rid`, stage it for the `/generate`
    request of that id) or, with `create_new_request`, restore and generate from
    `fill_ids + continuation_ids` computing only the new tokens."""
    s = get_serving(raw_request)
    _, turn = await asyncio.to_thread(_turn_of, s, body, raw_request)
    manager = s.conversations.manager
    if not manager.health.restore_allowed(manager.quarantine, body.conversation_id, turn.ref):
        raise APIError(
            409, f"the snapshot of turn {turn.ref} is quarantined and the health policy refuses to restore it", code="snapshot_quarantined"
        )
    state = await asyncio.to_thread(manager.load_into_warm, body.conversation_id, turn)
    if not body.create_new_request:
        if body.rid is not None:
            s.stage_state(caller_of(raw_request).tenant, body.rid, state)
        return {
            "success": True,
            "conversation_id": body.conversation_id,
            "branch_name": turn.branch,
            "turn_number": turn.turn,
            "state_len": state.state_len,
            "token_count": len(state.tokens),
            "rid": body.rid,
            "message": f"state of turn {turn.ref} restored",
        }
    prompt = list(state.tokens) + list(body.continuation_ids or [])
    params = s.sampling_params(body.sampling_fields())
    rid = body.rid or uuid.uuid4().hex
    start = time.perf_counter()
    outputs = await s.generate(engine_request_id(caller_of(raw_request).tenant, rid), prompt, params, initial_state=state)
    if body.stream:
        return sse_response(native_routes.generate_events(rid, False, start, outputs))
    out, _ = await collect(outputs)
    response = native_routes.generate_response(rid, out, None, start).model_dump()
    return {"success": True, "output_text": response["text"], **response}  # output_text: the predecessor's name


MAX_LISTED_CONVERSATIONS = 100


@router.get("/v1/conversations")
async def list_conversations(
    raw_request: Request, limit: int = Query(default=20, ge=1, le=MAX_LISTED_CONVERSATIONS), after: str | None = None
) -> dict[str, Any]:
    """The caller's conversations in id order, a page of `limit` from the first id past `after`."""
    manager = get_serving(raw_request).conversations.manager
    page = await asyncio.to_thread(manager.visible, caller_of(raw_request).restricted_to, after, limit + 1)
    data = [_conversation_summary(conv) for conv in page[:limit]]
    return {"object": "list", "data": data, "has_more": len(page) > limit, "last_id": data[-1]["id"] if data else None}


def _conversation_summary(conv: Conversation) -> dict[str, Any]:
    return {
        "id": conv.conversation_id,
        "object": "conversation",
        "created_at": conv.created_at,
        "owner": conv.owner,
        "latest_turns": {branch: head.turn for branch, head in conv.heads().items()},
    }


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, raw_request: Request) -> dict[str, Any]:
    s = get_serving(raw_request)
    conv = await asyncio.to_thread(s.conversations.manager.require, conversation_id, caller_of(raw_request).restricted_to)
    return {
        "id": conv.conversation_id,
        "object": "conversation",
        "created_at": conv.created_at,
        "owner": conv.owner,
        "epoch": s.epoch,
        "branches": {
            branch: {"latest_turn": head.turn, "token_count": len(conv.tokens(head)), "messages": conv.messages(head)}
            for branch, head in conv.heads().items()
        },
        "turns": [
            {
                "branch": t.branch,
                "turn": t.turn,
                "parent": t.parent,
                "snapshot": t.snapshot,
                "state_len": t.state_len,
                "created_at": t.created_at,
                "tool_calls": t.tool_calls,
                "tier": s.conversations.manager.tier_of(conv.conversation_id, t),
            }
            for t in sorted(conv.turns.values(), key=lambda t: (t.branch, t.turn))
        ],
    }


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, raw_request: Request) -> dict[str, Any]:
    manager = get_serving(raw_request).conversations.manager
    await asyncio.to_thread(manager.delete_conversation, conversation_id, caller_of(raw_request).restricted_to)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.get("/v1/state/stats")
async def state_stats(raw_request: Request) -> dict[str, Any]:
    s = get_serving(raw_request)
    manager = s.conversations.manager
    stats = manager.state_stats()
    tenant = caller_of(raw_request).restricted_to
    if tenant is not None:  # other tenants' conversation ids are not shown (their records are read off the event loop)
        quarantined = stats["quarantined"]
        stats["quarantined"] = await asyncio.to_thread(lambda: [q for q in quarantined if _visible(manager, q["conversation_id"], tenant)])
    engine = s.engine.stats()
    stats["tiers"]["active"]["engine_slots"] = engine.retained_slots - engine.prefix_slots  # conversations' only
    stats["engine"] = {
        "state_slots_used": engine.state_slots_used,
        "state_slots_total": engine.state_slots_total,
        "kv_blocks_used": engine.kv_blocks_used,
        "kv_blocks_total": engine.kv_blocks_total,
    }
    return stats
