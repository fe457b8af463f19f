"""OpenAI-compatible routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions`, and vLLM's
`/tokenize` and `/detokenize`."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engram.engine.async_engine import RequestOutputs
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
    PromptLogprob,
    PromptLogprobs,
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
from engram.state.turns import Turn

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
    elif request.prompt is not None:
        tokens = await s.encode_prompt(request.prompt, request.add_special_tokens)
    else:
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    return TokenizeResponse(count=len(tokens), max_model_len=s.engine.engine.max_context_length, tokens=tokens)


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> DetokenizeResponse:
    s = get_serving(raw_request)
    if request.model is not None:
        s.check_model(request.model)
    return DetokenizeResponse(prompt=await s.decode(request.tokens))


@router.post("/v1/chat/completions", response_model=None)
@cancel_on_disconnect
async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> StreamingResponse | ChatCompletionResponse:
    s = get_serving(raw_request)
    s.check_model(request.model)
    messages = [m.template_dict() for m in request.messages]
    params = s.sampling_params(request.sampling_fields())
    fmt = s.replies.format(*request.tool_setup(), request.chat_template_kwargs or {}, request.parallel_tool_calls)
    rid = f"chatcmpl-{request.request_id or uuid.uuid4().hex}"
    key = _idempotency_key(request, raw_request)
    _check_routing_header(request, raw_request)
    if request.conversation_id is None:
        where = ConversationFields()
        prompt = await s.encode_chat(messages, request.chat_template_options())
        tenant = caller_of(raw_request).tenant
        streams = await s.generate_choices(engine_request_id(tenant, rid), prompt, params, request.n, tenant)
    else:  # one choice (the protocol refuses n > 1 there)
        where, outputs = await _conversation_turn(s, request, request.conversation_id, rid, messages, params, caller_of(raw_request), key, fmt)
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
    prompt_logprobs = _prompt_logprobs(s, results[0][0].prompt_logprobs)
    return ChatCompletionResponse(id=rid, model=s.model_name, choices=choices, usage=usage, prompt_logprobs=prompt_logprobs, **where.model_dump())


def turn_call_ids(where: ConversationFields) -> str:
    """The call ids of a conversation turn: the same for a retry answered from the record."""
    return hashlib.sha256(f"{where.conversation_id}/{where.branch}/{where.turn}".encode()).hexdigest()[:24]


def _message(reply: Reply) -> AssistantMessage:
    calls = [ToolCallMessage(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in reply.calls]
    return AssistantMessage(content=reply.content or (None if calls else ""), reasoning_content=reply.reasoning, tool_calls=calls or None)


async def _conversation_turn(
    s: Serving,
    request: ChatCompletionRequest,
    conversation_id: str,
    rid: str,
    messages: list[dict[str, Any]],
    params: SamplingParams,
    caller: Caller,
    idempotency_key: str | None,
    fmt: ReplyFormat,
) -> tuple[ConversationFields, RequestOutputs]:
    """Start the next turn of a server-side conversation: restore its state, feed only the new tokens.
    A retry of a turn already made (same idempotency key) is answered as it was."""
    turns = s.conversations
    s.check_prompt_chars(message_chars(messages), "messages")
    timer = s.metrics.timer(conversation_id)  # from arrival: the turn's planning and its prompt count
    plan = await turns.begin(
        conversation_id, request.branch, request.from_turn, caller.restricted_to, idempotency_key, request.expected_turn, request.from_conversation
    )
    if isinstance(plan, Turn):
        where = ConversationFields(conversation_id=conversation_id, branch=plan.branch, turn=plan.turn, epoch=s.epoch)
        return where, _one(await asyncio.to_thread(turns.replay, conversation_id, plan, messages))  # reads the record: off the event loop
    try:
        messages = new_messages(plan.history_messages, messages)
        # the template and tokenizer, off the event loop
        prompt = await asyncio.to_thread(turns.prompt, plan, messages, params.max_tokens != 0, request.chat_template_options())
        outputs = await turns.start(plan, functools.partial(s.generate, engine_request_id(caller.tenant, rid), prompt, params, timer))
    except BaseException:
        turns.manager.release(plan.conversation_id)
        raise
    where = ConversationFields(conversation_id=plan.conversation_id, branch=plan.branch, turn=plan.turn, epoch=s.epoch)
    return where, turns.record(rid, plan, messages, outputs, dataclasses.replace(fmt, call_ids=turn_call_ids(where)))


async def _one(out: RequestOutput) -> RequestOutputs:
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


def _check_routing_header(request: ChatCompletionRequest, raw_request: Request) -> None:
    """X-Conversation-Id is the router's key for a turn (docs/DEPLOYMENT.md): one naming another
    conversation than the body's would route turns of one conversation to several replicas."""
    header = raw_request.headers.get("x-conversation-id")
    if header is not None and header != request.conversation_id:
        raise APIError(
            400,
            f"the X-Conversation-Id header {header!r:.140} is not the body's conversation_id "
            f"{request.conversation_id!r}: send the same value in both",
            param="X-Conversation-Id",
        )


async def _chat_events(
    s: Serving,
    request: ChatCompletionRequest,
    rid: str,
    streams: list[RequestOutputs],
    where: ConversationFields,
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
                    yield sse(
                        chunk([ChatChunkChoice(index=i, delta=delta or DeltaMessage(), logprobs=logprobs, **_finish(s, out, readers[i].calls))])
                    )
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
async def completions(request: CompletionRequest, raw_request: Request) -> StreamingResponse | CompletionResponse:
    s = get_serving(raw_request)
    s.check_model(request.model)
    prompts = [await s.encode_prompt(prompt, request.add_special_tokens) for prompt in request.prompts]
    params = s.sampling_params(request.sampling_fields())
    rid = f"cmpl-{request.request_id or uuid.uuid4().hex}"
    engine_rid = engine_request_id(caller_of(raw_request).tenant, rid)
    streams: list[RequestOutputs] = []
    try:
        for i, prompt_ids in enumerate(prompts):  # prompt-major: choice j of prompt i is i * n + j
            streams += await s.generate_choices(
                engine_rid if len(prompts) == 1 else f"{engine_rid}-p{i}", prompt_ids, params, request.n, caller_of(raw_request).tenant
            )
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    echoes = [await _echo(s, prompt, ids) if request.echo else None for prompt, ids in zip(request.prompts, prompts) for _ in range(request.n)]
    if request.stream:
        return sse_response(_completion_events(s, request, rid, streams, echoes))
    results = await collect_choices(streams)
    choices = []
    for i, ((out, logprobs), echo) in enumerate(zip(results, echoes)):
        entries = logprobs if params.logprobs is not None else None
        text = out.text if echo is None else echo.text + out.text
        choices.append(
            CompletionChoice(
                index=i,
                text=text,
                logprobs=_completion_logprobs(s, entries, 0, echo, out.prompt_logprobs),
                prompt_logprobs=_prompt_logprobs(s, out.prompt_logprobs),
                **_finish(s, out),
            )
        )
    outs = [out for out, _ in results]
    return CompletionResponse(id=rid, model=s.model_name, choices=choices, usage=Usage.total(outs, request.n))


@dataclasses.dataclass
class _Echo:
    """An echoed prompt: its text, and its tokens (for their logprobs)."""

    text: str
    token_ids: list[int]


async def _echo(s: Serving, prompt: str | list[int], prompt_ids: list[int]) -> _Echo:
    """As vLLM: a text prompt as it was sent, token ids decoded."""
    return _Echo(prompt if isinstance(prompt, str) else await s.decode(prompt_ids), prompt_ids)


async def _completion_events(
    s: Serving, request: CompletionRequest, rid: str, streams: list[RequestOutputs], echoes: list[_Echo | None]
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=rid, created=created, model=s.model_name, choices=choices, usage=usage)

    text_events = TextEvents(lambda i, text: chunk([CompletionChoice(index=i, text=text)]))
    last: dict[int, RequestOutput] = {}
    echoed: set[int] = set()
    async with aclosing(interleave(streams)) as outputs:
        async for i, out in outputs:
            last[i] = out
            prompt_echo = echoes[i]
            echo = prompt_echo if i not in echoed else None
            echoed.add(i)
            if echo is None and out.new_text and out.logprobs is None and not out.finished:  # most tokens: the chunk serialized once
                yield text_events(i, out.new_text)
            elif echo is not None or out.new_text or out.logprobs or out.finished:
                offset = len(out.text) - len(out.new_text) + (len(prompt_echo.text) if prompt_echo is not None else 0)
                logprobs = _completion_logprobs(s, out.logprobs, offset if echo is None else 0, echo, out.prompt_logprobs)
                text = out.new_text if echo is None else echo.text + out.new_text
                yield sse(chunk([CompletionChoice(index=i, text=text, logprobs=logprobs, **_finish(s, out))]))
    if request.include_usage:
        yield sse(chunk([], Usage.total([last[i] for i in sorted(last)], request.n)))


def _delta(d: ReplyDelta) -> DeltaMessage | None:
    if not d:
        return None
    calls = [
        DeltaToolCall(
            index=c.index,
            id=c.id,
            type="function" if c.id else None,
            function=DeltaFunctionCall(name=c.name, arguments=c.arguments if c.id or c.arguments else None),
        )
        for c in d.calls
    ]
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
        ChatTokenLogprob(**_top_logprob(s, lp.token_id, lp.logprob).model_dump(), top_logprobs=[_top_logprob(s, t, v) for t, v in lp.top])
        for lp in logprobs
    ]
    return ChatLogprobs(content=content)


def _completion_logprobs(
    s: Serving,
    logprobs: list[TokenLogprob] | None,
    offset: int,
    echo: _Echo | None = None,
    prompt_logprobs: list[TokenLogprob | None] | None = None,
) -> CompletionLogprobs | None:
    """OpenAI's logprobs of a completion's tokens; with an echoed prompt, the prompt's tokens first
    and their `prompt_logprobs` (the first token has none), as vLLM."""
    if logprobs is None:
        return None
    token_ids = [lp.token_id for lp in logprobs]
    entries: list[TokenLogprob | None] = list(logprobs)
    if echo is not None and prompt_logprobs is not None:
        token_ids, entries = echo.token_ids + token_ids, [*prompt_logprobs, *entries]
    tokens = [s.token_text(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[lp.logprob if lp is not None else None for lp in entries],
        top_logprobs=[{s.token_text(t): v for t, v in lp.top} if lp is not None else None for lp in entries],
        text_offset=offsets,
    )


def _prompt_logprobs(s: Serving, logprobs: list[TokenLogprob | None] | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: per prompt token (none for the first), its own and the top ones."""
    if logprobs is None:
        return None
    result: PromptLogprobs = [None]
    for lp in logprobs[1:]:
        assert lp is not None, "every prompt token but the first has a logprob"
        entry = {t: PromptLogprob(logprob=v, rank=rank, decoded_token=s.token_text(t)) for rank, (t, v) in enumerate(lp.top, 1)}
        entry.setdefault(lp.token_id, PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=s.token_text(lp.token_id)))
        result.append(entry)
    return result
