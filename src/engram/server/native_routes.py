"""SGLang-native routes: `/generate`, health, model and server info, metrics, the admin
`/abort_request` and `/flush_cache`; and vLLM's `/version`."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engram.engine.async_engine import RequestOutputs
from engram.engine.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob
from engram.server.auth import caller_is_admin, caller_of
from engram.server.errors import APIError
from engram.server.protocol import AbortRequest, GenerateRequest, GenerateResponse, MetaInfo
from engram.server.serving import collect, collect_choices, engine_request_id, get_serving, interleave
from engram.server.streaming import cancel_on_disconnect, sse, sse_response

router = APIRouter()
admin_router = APIRouter()  # guarded by --admin-api-key

HEALTH_GENERATE_TIMEOUT_S = 20.0
SECRET_ARGS = ("api_key", "admin_api_key")
PATH_ARGS = ("model_path", "snapshot_dir", "snapshot_store")  # shown to admins only
TokenText = Callable[[int], str]


@router.post("/generate", response_model=None)
@cancel_on_disconnect
async def generate(request: GenerateRequest, raw_request: Request) -> StreamingResponse | GenerateResponse | list[GenerateResponse]:
    s = get_serving(raw_request)
    s.check_model(request.model)
    prompts = [await s.encode_prompt(prompt) for prompt in request.prompts]
    params = s.sampling_params(request.sampling_fields())
    start = time.perf_counter()
    tenant = caller_of(raw_request).tenant
    n = request.sampling_params.n
    token_text = s.token_text if request.return_text_in_logprobs else None
    if not request.is_batch and n == 1:
        rid = request.rid if isinstance(request.rid, str) else uuid.uuid4().hex
        outputs = await s.generate(
            engine_request_id(tenant, rid), prompts[0], params, initial_state=s.take_staged_state(tenant, rid), cache_prefix=True, tenant=tenant
        )
        if request.stream:
            return sse_response(generate_events(rid, request.return_logprob, start, outputs, token_text))
        out, logprobs = await collect(outputs)
        return generate_response(rid, out, logprobs if request.return_logprob else None, start, token_text)
    rids = request.rid if isinstance(request.rid, list) else [request.rid or uuid.uuid4().hex] * len(prompts)
    names = [rid if n == 1 else f"{rid}-{j}" for rid in rids for j in range(n)]  # prompt-major, as SGLang
    streams: list[RequestOutputs] = []
    try:
        for i, (rid, prompt_ids) in enumerate(zip(rids, prompts)):
            engine_rid = engine_request_id(tenant, rid if isinstance(request.rid, list) else f"{rid}-p{i}")
            streams += await s.generate_choices(engine_rid, prompt_ids, params, n, tenant)
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    if request.stream:
        return sse_response(batch_events(names, request.return_logprob, start, streams, token_text))
    results = await collect_choices(streams)
    return [
        generate_response(name, out, logprobs if request.return_logprob else None, start, token_text) for name, (out, logprobs) in zip(names, results)
    ]


async def generate_events(
    rid: str, return_logprob: bool, start: float, outputs: AsyncIterator[RequestOutput], token_text: TokenText | None = None
) -> AsyncIterator[str]:
    """SGLang streams cumulative responses: each event holds the text and ids so far."""
    logprobs: list[TokenLogprob] = []
    async for out in outputs:
        logprobs += out.logprobs or []
        yield sse(generate_response(rid, out, logprobs if return_logprob else None, start, token_text))


async def batch_events(
    names: list[str], return_logprob: bool, start: float, streams: list[RequestOutputs], token_text: TokenText | None
) -> AsyncIterator[str]:
    """A batch's streams (prompt-major, n per prompt) as they come: each event is `generate_events`'
    cumulative response of one of them, with its `index` in the batch (as SGLang)."""
    logprobs: list[list[TokenLogprob]] = [[] for _ in streams]
    async with aclosing(interleave(streams)) as outputs:
        async for i, out in outputs:
            logprobs[i] += out.logprobs or []
            response = generate_response(names[i], out, logprobs[i] if return_logprob else None, start, token_text)
            yield sse({**response.model_dump(), "index": i})


def generate_response(
    rid: str, out: RequestOutput, logprobs: list[TokenLogprob] | None, start: float, token_text: TokenText | None = None
) -> GenerateResponse:
    """`token_text`: SGLang's return_text_in_logprobs, each logprob's token text beside its id."""
    meta = MetaInfo(
        id=rid,
        finish_reason=_finish_reason(out),
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=len(out.token_ids),
        cached_tokens=out.num_cached_tokens,
        e2e_latency=time.perf_counter() - start,
    )
    if logprobs is not None:

        def text(token_id: int) -> str | None:
            return token_text(token_id) if token_text is not None else None

        meta.output_token_logprobs = [(lp.logprob, lp.token_id, text(lp.token_id)) for lp in logprobs]
        meta.output_top_logprobs = [[(v, t, text(t)) for t, v in lp.top] for lp in logprobs]
    return GenerateResponse(text=out.text, output_ids=out.token_ids, meta_info=meta)


def _finish_reason(out: RequestOutput) -> dict[str, Any] | None:
    if out.finish_reason is None:
        return None
    if out.finish_reason == FinishReason.LENGTH:
        return {"type": "length", "length": len(out.token_ids)}
    if out.finish_reason == FinishReason.ABORT:
        return {"type": "abort", "message": "the request was aborted"}
    return {"type": "stop", "matched": out.stop_reason}


@router.get("/health")
async def health(raw_request: Request) -> Response:
    """200 once the engine runs and has warmed up; before that 503 with {"status", "stage"}."""
    s = get_serving(raw_request)
    if not s.engine.is_alive:
        raise APIError(503, "the engine is not running")
    if s.startup.status != "ready":
        return JSONResponse(dataclasses.asdict(s.startup), status_code=503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(raw_request: Request) -> Response:
    """Generate one token end to end (bypassing the request metrics)."""
    engine = get_serving(raw_request).engine
    params = SamplingParams(max_tokens=1, temperature=0.0)

    async def one_token() -> None:
        async for _ in engine.generate(f"health-{uuid.uuid4().hex}", [0], params):
            pass

    try:
        await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        raise APIError(503, f"the engine generated no token within {HEALTH_GENERATE_TIMEOUT_S:g} s") from None
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(raw_request: Request) -> dict[str, Any]:
    s = get_serving(raw_request)
    core = s.engine.engine
    path = str(core.model_path) if caller_is_admin(raw_request) else s.model_name  # server paths go to admins only
    return {
        "model_path": path,
        "tokenizer_path": path if s.tokenizer is not None else None,
        "served_model_name": s.model_name,
        "is_generation": True,
        "architecture": core.spec.architecture,
        "model_type": core.spec.model_type,
        "context_length": core.max_context_length,
        "vocab_size": core.spec.vocab_size,
        "layers": core.spec.layout(),
    }


def _version() -> str:
    try:
        return importlib.metadata.version("engram")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": _version()}


@router.get("/get_server_info")
async def get_server_info(raw_request: Request) -> dict[str, Any]:
    """The version, the epoch (new at every start) and the arguments the server and engine run with
    (API keys redacted, and server paths for all but admins)."""
    hidden = SECRET_ARGS if caller_is_admin(raw_request) else SECRET_ARGS + PATH_ARGS
    s = get_serving(raw_request)
    server_args = _redacted(dataclasses.asdict(raw_request.app.state.server_args), hidden)
    engine_args = _redacted(dataclasses.asdict(s.engine.engine.args), hidden)
    return {"version": _version(), "epoch": s.epoch, "server_args": server_args, "engine_args": engine_args}


def _redacted(args: dict[str, Any], hidden: tuple[str, ...]) -> dict[str, Any]:
    return {key: "<redacted>" if key in hidden and value else value for key, value in args.items()}


@admin_router.post("/abort_request")
async def abort_request(request: AbortRequest, raw_request: Request) -> dict[str, Any]:
    """Abort a running request by its rid (or every one): its client gets what it has, finish reason
    abort. An admin route: it acts on other clients' requests; a tenant's key (which opens it on a
    server without --admin-api-key) reaches only that tenant's requests."""
    engine = get_serving(raw_request).engine
    tenant = caller_of(raw_request).tenant
    if request.rid is not None:  # the protocol refuses a rid with abort_all
        await engine.abort(engine_request_id(tenant, request.rid))
    else:
        await engine.abort_all(prefix="" if tenant is None else engine_request_id(tenant, ""))
    return {"success": True}


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    return Response(get_serving(raw_request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@admin_router.get("/flush_cache", operation_id="flush_cache_get")  # SGLang answers both methods
@admin_router.post("/flush_cache", operation_id="flush_cache_post")
async def flush_cache(raw_request: Request) -> dict[str, Any]:
    if not await get_serving(raw_request).flush_cache():
        raise APIError(409, "the cache was not flushed: requests are running; retry when idle")
    return {"success": True, "message": "cache flushed"}
