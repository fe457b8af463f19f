"""OpenAI-compatible routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions`, and vLLM's
`/tokenize` and `/detokenize`."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request

from engram.engine.request import RequestOutput, SamplingParams, TokenLogprob
from engram.server.auth import Caller, caller_is_admin, caller_of
from engram.server.chat_reply import Reply, ReplyDelta, ReplyFormat
from engram.server.conversations import new_messages
from engram.server.errors import APIError
from engram.server.protocol import (
    IDEMPOTENCY_KEY_PATTERN,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ConversationFields,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    Usage,
)
from engram.server.serving import (
    Serving,
    collect_choices,
    engine_request_id,
    get_serving,
    interleave,
    message_chars,
)
from engram.server.streaming import TextEvents, cancel_on_disconnect, sse, sse_response
from engram.server.tool_parsers import ToolCall
from engram.server.tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCallMessage
from engram.state.conversations import Turn

router = APIRouter()


@router.get("/v1/models")
async def list_models(raw_request: Request) -> ModelList:
    s = get_serving(raw_request)
    core = s.engine.engine
    root = str(core.model_path) if caller_is_admin(raw_request) else s.model_name  # server paths go to admins only
    card = ModelCard(id=s.model_name, created=s.created, root=root, max_model_len=core.max_context_length)
    return ModelList(data=[card])


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> TokenizeResponse:
    s = get_serving(raw_request)
    if request.model is not None:
        s.check_model(request.model)
    if request.messages is not None:
        tokens = await s.encode_chat([m.template_dict() for m in request.messages], request.template_options())
    else:
        tokens = await s.encode_prompt(request.prompt, request.add_special_tokens)
    return TokenizeResponse(count=len(tokens), max_model_len=s.engine.engine.max_context_length, tokens=tokens)


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> DetokenizeResponse:
    s = get_serving(raw_request)
    if request.model is not None:
        s.check_model(request.model)
    return DetokenizeResponse(prompt=await s.decode(request.tokens))


@router.post("/v1/chat/completions", response_model=None)
@cancel_on_disconnect
async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
    s = get_serving(raw_request)
    s.check_model(request.model)
    messages = [m.template_dict() for m in request.messages]
    params = s.sampling_params(request.sampling_fields())
    fmt = s.replies.format(*request.tool_setup(), request.chat_template_kwargs or {}, request.parallel_tool_calls)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    key = _idempotency_key(request, raw_request)
    if request.conversation_id is None:
        where = ConversationFields()
        prompt = await s.encode_chat(messages, request.chat_template_options())
        streams = await s.generate_choices(engine_request_id(caller_of(raw_request).tenant, rid), prompt, params, request.n)
    else:  # one choice (the protocol refuses n > 1 there)
        where, outputs = await _conversation_turn(s, request, rid, messages, params, caller_of(raw_request), key, fmt)
        fmt = dataclasses.replace(fmt, call_ids=turn_call_ids(where))
        streams = [outputs]
    if request.stream:
        return sse_response(_chat_events(s, request, rid, streams, where, fmt))
    results = await collect_choices(streams)
    replies = [fmt.read(out.text, i) for i, (out, _) in enumerate(results)]
    choices = [
        ChatChoice(
            index=i,
            message=_message(reply),
            logprobs=_chat_logprobs(s, logprobs if params.logprobs is not None else None),
            **_finish(s, out, reply.calls),
        )
        for i, ((out, logprobs), reply) in enumerate(zip(results, replies))
    ]
    usage = Usage.of(*(out for out, _ in results))
    return ChatCompletionResponse(id=rid, model=s.model_name, choices=choices, usage=usage, **where.model_dump())


def turn_call_ids(where: ConversationFields) -> str:
    """The call ids of a conversation turn: the same for a retry answered from the record."""
    return hashlib.sha256(f"{where.conversation_id}/{where.branch}/{where.turn}".encode()).hexdigest()[:24]


def _message(reply: Reply) -> AssistantMessage:
    calls = [ToolCallMessage(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in reply.calls]
    return AssistantMessage(content=reply.content or (None if calls else ""), reasoning_content=reply.reasoning, tool_calls=calls or None)


async def _conversation_turn(
    s: Serving, request: ChatCompletionRequest, rid: str, messages: list[dict], params: SamplingParams, caller: Caller,
    idempotency_key: str | None, fmt: ReplyFormat,
) -> tuple[ConversationFields, AsyncIterator[RequestOutput]]:
    """Start the next turn of a server-side conversation: restore its state, feed only the new tokens.
    A retry of a turn already made (same idempotency key) is answered as it was."""
    turns = s.conversations
    s.check_prompt_chars(message_chars(messages), "messages")
    timer = s.metrics.timer(request.conversation_id)  # from arrival: the turn's planning and its prompt count
    plan = await turns.begin(request.conversation_id, request.branch, request.from_turn, caller.restricted_to, idempotency_key,
                             request.expected_turn, request.from_conversation)
    if isinstance(plan, Turn):
        where = ConversationFields(conversation_id=request.conversation_id, branch=plan.branch, turn=plan.turn, epoch=s.epoch)
        return where, _one(turns.replay(request.conversation_id, plan, messages))
    try:
        messages = new_messages(plan.history_messages, messages)
        # the template and tokenizer, off the event loop
        prompt = await asyncio.to_thread(turns.prompt, plan, messages, params.max_tokens != 0, request.chat_template_options())
        outputs = await s.generate(engine_request_id(caller.tenant, rid), prompt, params, timer, **turns.engine_kwargs(plan))
    except BaseException:
        turns.manager.release(plan.conversation_id)
        raise
    where = ConversationFields(conversation_id=plan.conversation_id, branch=plan.branch, turn=plan.turn, epoch=s.epoch)
    return where, turns.record(rid, plan, messages, outputs, dataclasses.replace(fmt, call_ids=turn_call_ids(where)))


async def _one(out: RequestOutput) -> AsyncIterator[RequestOutput]:
    yield out


def _idempotency_key(request: ChatCompletionRequest, raw_request: Request) -> str | None:
    """The turn's idempotency key: the `Idempotency-Key` header, or the `turn_id` field."""
    header = raw_request.headers.get("idempotency-key")
    if header is None:
        return request.turn_id
    if not re.fullmatch(IDEMPOTENCY_KEY_PATTERN, header):
        raise APIError(400, "the Idempotency-Key header must be 1 to 256 visible ASCII characters", param="Idempotency-Key")
    if request.conversation_id is None:
        raise APIError(400, "Idempotency-Key makes a conversation turn exactly-once: it needs a conversation_id", param="Idempotency-Key")
    if request.turn_id not in (None, header):
        raise APIError(400, "the Idempotency-Key header and turn_id differ", param="turn_id")
    return header


async def _chat_events(
    s: Serving, request: ChatCompletionRequest, rid: str, streams: list[AsyncIterator[RequestOutput]], where: ConversationFields,
    fmt: ReplyFormat,
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, created=created, model=s.model_name, choices=choices, usage=usage, **where.model_dump())

    text_events = TextEvents(lambda i, text: chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=text))]))
    yield sse(chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(len(streams))]))
    last: dict[int, RequestOutput] = {}
    readers = {i: fmt.reader(i) for i in range(len(streams))} if not fmt.plain else {}
    async with aclosing(interleave(streams)) as outputs:
        async for i, out in outputs:
            last[i] = out
            if i in readers:  # parsed: what the text so far adds to the reasoning, content and tool calls
                delta = _delta(readers[i].feed(out.text, out.finished))
                if delta is not None or out.logprobs or out.finished:
                    logprobs = _chat_logprobs(s, out.logprobs)
                    yield sse(chunk([ChatChunkChoice(index=i, delta=delta or DeltaMessage(), logprobs=logprobs,
                                                     **_finish(s, out, readers[i].calls))]))
            elif out.new_text and out.logprobs is None and not out.finished:  # most tokens: the chunk serialized once
                yield text_events(i, out.new_text)
            elif out.new_text or out.logprobs or out.finished:
                delta = DeltaMessage(content=out.new_text or None)
                logprobs = _chat_logprobs(s, out.logprobs)
                yield sse(chunk([ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, **_finish(s, out))]))
    if request.include_usage:
        yield sse(chunk([], Usage.of(*last.values())))


@router.post("/v1/completions", response_model=None)
@cancel_on_disconnect
async def completions(request: CompletionRequest, raw_request: Request):
    s = get_serving(raw_request)
    s.check_model(request.model)
    prompt_ids = await s.encode_prompt(request.prompt)
    params = s.sampling_params(request.sampling_fields())
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = await s.generate_choices(engine_request_id(caller_of(raw_request).tenant, rid), prompt_ids, params, request.n)
    if request.stream:
        return sse_response(_completion_events(s, request, rid, streams))
    results = await collect_choices(streams)
    choices = [
        CompletionChoice(
            index=i,
            text=out.text,
            logprobs=_completion_logprobs(s, logprobs if params.logprobs is not None else None, 0),
            **_finish(s, out),
        )
        for i, (out, logprobs) in enumerate(results)
    ]
    return CompletionResponse(id=rid, model=s.model_name, choices=choices, usage=Usage.of(*(out for out, _ in results)))


async def _completion_events(
    s: Serving, request: CompletionRequest, rid: str, streams: list[AsyncIterator[RequestOutput]]
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=rid, created=created, model=s.model_name, choices=choices, usage=usage)

    text_events = TextEvents(lambda i, text: chunk([CompletionChoice(index=i, text=text)]))
    last: dict[int, RequestOutput] = {}
    async with aclosing(interleave(streams)) as outputs:
        async for i, out in outputs:
            last[i] = out
            if out.new_text and out.logprobs is None and not out.finished:  # most tokens: the chunk serialized once
                yield text_events(i, out.new_text)
            elif out.new_text or out.logprobs or out.finished:
                offset = len(out.text) - len(out.new_text)
                logprobs = _completion_logprobs(s, out.logprobs, offset)
                yield sse(chunk([CompletionChoice(index=i, text=out.new_text, logprobs=logprobs, **_finish(s, out))]))
    if request.include_usage:
        yield sse(chunk([], Usage.of(*last.values())))


def _delta(d: ReplyDelta) -> DeltaMessage | None:
    if not d:
        return None
    calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                           function=DeltaFunctionCall(name=c.name, arguments=c.arguments if c.id or c.arguments else None))
             for c in d.calls]
    return DeltaMessage(content=d.content or None, reasoning_content=d.reasoning or None, tool_calls=calls or None)


def _finish(s: Serving, out: RequestOutput, calls: list[ToolCall] | None = None) -> dict[str, Any]:
    """A choice's finish_reason ("tool_calls" when it stopped after calling tools), and (as vLLM)
    the stop string or token id that ended it, None for EOS."""
    stop = None if out.stop_reason in s.engine.engine.eos_token_ids else out.stop_reason
    reason = out.finish_reason.value if out.finish_reason is not None else None
    return {"finish_reason": "tool_calls" if calls and reason == "stop" else reason, "stop_reason": stop}


def _top_logprob(s: Serving, token_id: int, logprob: float) -> TopLogprob:
    text = s.token_text(token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def _chat_logprobs(s: Serving, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
    if logprobs is None:
        return None
    content = [
        ChatTokenLogprob(**_top_logprob(s, lp.token_id, lp.logprob).model_dump(),
                         top_logprobs=[_top_logprob(s, t, v) for t, v in lp.top])
        for lp in logprobs
    ]
    return ChatLogprobs(content=content)


def _completion_logprobs(s: Serving, logprobs: list[TokenLogprob] | None, offset: int) -> CompletionLogprobs | None:
    if logprobs is None:
        return None
    tokens = [s.token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[lp.logprob for lp in logprobs],
        top_logprobs=[{s.token_text(t): v for t, v in lp.top} for lp in logprobs],
        text_offset=offsets,
    )
