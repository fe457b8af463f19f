"""What every route shares: the engine, the tokenizer, the served model name and the metrics.

The server deals in token ids and strings only; `Serving` is where text becomes token ids,
request fields become `SamplingParams`, and a request is started on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

import jinja2
from fastapi import Request

from engram.engine.async_engine import AsyncEngine, RequestOutputs
from engram.engine.request import SEED_RANGE, RequestOutput, SamplingParams, StructuredOutputsParams, TokenLogprob
from engram.server.chat_reply import ReplyParsers
from engram.server.conversations import ConversationTurns
from engram.server.errors import APIError
from engram.server.metrics import Metrics, RequestTimer
from engram.server.prompt_tokens import PromptEncoder
from engram.server.tokens import encode
from engram.state.prefix_cache import PrefixCache

MAX_STAGED_STATES = 64
# From this many prompt tokens, the n choices of a request share one prefill: the state one token
# short of the prompt is computed once and restored into every choice, which computes the last one.
SHARED_PREFILL_MIN_TOKENS = 256
# Retained engine slots of finished requests of no conversation, the prefix cache's GPU tier, under
# `:prefix:<tenant>:` (conversations retain theirs under their ids, tenants have names, and neither
# holds a colon): a tenant's prompt never adopts another's slot, so no reply is told by cached_tokens.
PREFIX_SLOT_KEY = ":prefix:"


@dataclasses.dataclass
class Startup:
    """What `/health` reports until the server is ready (server/startup.py moves it on)."""

    status: str = "warming"  # warming | ready | failed
    stage: str = "starting"


def engine_request_id(tenant: str | None, rid: str) -> str:
    """The engine's id of `tenant`'s request `rid`. A tenant's ids are its own: one cannot collide
    with another's (refused as "already in use", which would tell it that the other's request is
    running) nor abort it. The admin's, and every caller's of a server without keys, are as given,
    so the admin reaches a tenant's request as "<tenant>:<rid>"."""
    return rid if tenant is None else f"{tenant}:{rid}"


class Serving:
    def __init__(self, engine: AsyncEngine, model_name: str, conversations: ConversationTurns, replies: ReplyParsers | None = None) -> None:
        self.engine = engine
        self.replies = replies or ReplyParsers()  # --tool-call-parser, --reasoning-parser
        self.model_name = model_name
        self.metrics = Metrics(engine, conversations.manager, model_name)
        # Any: transformers types decode's and apply_chat_template's results as unions with their batched forms
        self.tokenizer: Any = engine.engine.tokenizer
        self.max_prompt_chars = engine.engine.max_context_length * _longest_token(self.tokenizer)
        self.prompt_encoder = PromptEncoder(self.tokenizer)  # a resent history is not encoded again
        self.conversations = conversations
        self.staged_states: OrderedDict[tuple[str | None, str], Any] = OrderedDict()  # (tenant, rid) -> state from /restore_snapshot
        self.created = int(time.time())
        self.startup = Startup()
        self.epoch = secrets.token_hex(8)  # new at every start: a client that sees it change knows the server restarted

    def stage_state(self, tenant: str | None, rid: str, state: Any) -> None:
        """Hold a restored state for the `/generate` request of `tenant` (None: the admin or an open
        server) that will carry this rid. Per tenant: another's request of the same rid neither
        takes it nor learns of it (a state that does not start its prompt would be refused, naming
        its length)."""
        self.staged_states[tenant, rid] = state
        while len(self.staged_states) > MAX_STAGED_STATES:
            self.staged_states.popitem(last=False)

    def take_staged_state(self, tenant: str | None, rid: str) -> Any:
        return self.staged_states.pop((tenant, rid), None)

    async def flush_cache(self) -> bool:
        """SGLang's /flush_cache: free the retained engine slots and empty the in-memory prefix
        cache (snapshots and the prefix cache's disk tier stay); False while requests run."""
        if not await self.engine.flush_cache():
            return False
        if self.conversations.manager.prefix_cache is not None:
            self.conversations.manager.prefix_cache.clear()
        return True

    def check_model(self, name: str | None) -> None:
        """A request's `model`: the served one, or None (OpenAI requires it; vLLM does not)."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}", param="model", code="model_not_found")

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "the model has no tokenizer: send token ids instead of text")
        return self.tokenizer

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a prompt of more characters than the context's tokens can
        hold (each at most as long as the vocabulary's longest token)."""
        if chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"{param}: {chars} characters, more than the {self.max_prompt_chars} that the context of "
                f"{self.engine.engine.max_context_length} tokens can hold",
                param=param,
            )

    async def encode_chat(self, messages: list[dict[str, Any]], template_options: dict[str, Any]) -> list[int]:
        """The messages through the chat template, off the event loop; `template_options`
        (add_generation_prompt, continue_final_message, the template's own variables) go to the template."""
        self._require_tokenizer()
        self.check_prompt_chars(message_chars(messages), "messages")
        return await asyncio.to_thread(_render_and_encode, self.prompt_encoder, messages, template_options)

    async def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Text to token ids, off the event loop; token ids as they are."""
        if not isinstance(prompt, str):
            return prompt
        tokenizer = self._require_tokenizer()
        self.check_prompt_chars(len(prompt), "prompt")
        return await asyncio.to_thread(encode, tokenizer, prompt, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        with _bad_input_is_400():
            self.engine.engine.check_in_vocabulary("token ids", token_ids)
        return await asyncio.to_thread(self._require_tokenizer().decode, token_ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    @staticmethod
    def sampling_params(fields: dict[str, Any]) -> SamplingParams:
        """Build SamplingParams from request fields named like its own; None keeps its default,
        except for max_tokens, where None means up to the context length (OpenAI's chat default)."""
        with _bad_input_is_400():
            return SamplingParams(**{k: v for k, v in fields.items() if v is not None or k == "max_tokens"})

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        timer: RequestTimer | None = None,
        cache_prefix: bool = False,
        tenant: str | None = None,
        **kwargs: Any,
    ) -> RequestOutputs:
        """Start a request and wait for its first output, so that bad input (the engine raises
        ValueError) is answered with 400 before a response, streaming or not, has begun. `timer`:
        when the request arrived, if before now. `cache_prefix`: a request of no conversation,
        which starts from the prefix cache's longest match and leaves its prompt's state there
        (with prefix caching on), `tenant`'s own GPU slots first. `kwargs` go to the engine (a state to restore, whether to capture
        the final state, the compiled grammar)."""
        timer = timer or self.metrics.timer()
        if params.structured_outputs is not None and "grammar" not in kwargs:
            kwargs["grammar"] = await self.compile_grammar(params.structured_outputs)
        # prompt logprobs read every prompt position: nothing of the prompt may come from the cache
        from_cache = cache_prefix and kwargs.get("initial_state") is None and params.prompt_logprobs is None
        cache = self.conversations.manager.prefix_cache if from_cache else None
        if cache is not None and not cache.wants(len(prompt_ids)):
            cache = None
        if cache is not None:
            # the GPU tier: the final state stays in its slot (until the engine needs the room), for a prompt that extends it
            slots = f"{PREFIX_SLOT_KEY}{tenant or ''}:"
            engine = self.engine.engine
            staging = self.conversations.manager.new_staging()  # a hit read from disk is copied to the device as it is read
            # only a state longer than the GPU tier's is worth reading from the host tiers (both compare the whole prompt: off the event loop)
            state = await asyncio.to_thread(lambda: cache.lookup(prompt_ids, staging, engine.prefix_slot_covers(prompt_ids, slots)))
            kwargs = {**kwargs, "initial_state": state, "capture_prompt_state": True, "staged": staging if state is not None else None}
            kwargs["prefix_slots"] = slots
        outputs = self.engine.generate(request_id, prompt_ids, params, **kwargs)
        with _bad_input_is_400():
            first = await anext(outputs)
        timed = _timed(outputs, first, timer)
        return _admitting(timed, cache) if cache is not None else timed

    async def generate_choices(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, n: int, tenant: str | None = None
    ) -> list[RequestOutputs]:
        """`generate` for OpenAI's n choices of one prompt, each its own engine request, started
        together (after their shared prefill, for long prompts). Returns once the first has its first
        output (bad input fails them all alike), so a stream begins while choices beyond the free
        engine slots still wait for one. With a seed, choice i draws from seed + i (the same choices
        for the same seed)."""
        if n == 1:
            return [await self.generate(request_id, prompt_ids, params, cache_prefix=True, tenant=tenant)]
        timers = [self.metrics.timer() for _ in range(n)]
        grammar = await self.compile_grammar(params.structured_outputs) if params.structured_outputs is not None else None
        state = None
        if len(prompt_ids) >= SHARED_PREFILL_MIN_TOKENS and params.prompt_logprobs is None:
            with _bad_input_is_400():  # before computing the prefix for nothing
                self.engine.engine.check_request(prompt_ids, params)
            state = await self._prefill_state(f"{request_id}-prompt", prompt_ids[:-1])
        shared = {"initial_state": state} if state is not None else {}  # None: the prefill was cut short
        shared |= {"grammar": grammar} if grammar is not None else {}
        starts = [
            asyncio.ensure_future(self.generate(f"{request_id}-{i}", prompt_ids, _nth_choice(params, i), timers[i], **shared)) for i in range(n)
        ]
        try:
            done, _ = await asyncio.wait(starts, return_when=asyncio.FIRST_COMPLETED)
            for start in done:
                start.result()  # raises the failure of a choice that could not start
        except BaseException:
            for start in starts:
                start.cancel()
            raise
        shared_len = len(prompt_ids) - 1 if state is not None else 0
        return [_started(start, shared_len) for start in starts]

    async def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """The request's grammar, compiled in a thread (neither the event loop nor the engine thread
        waits for it); one that does not compile is a 400 naming its field."""
        try:
            return await asyncio.to_thread(self.engine.engine.compile_grammar, params)
        except ValueError as e:
            raise APIError(400, str(e), param=params.source) from None

    async def embed(self, request_id: str, prompt_ids: list[int]) -> list[float]:
        """The mean of the prompt's last hidden states (the engine's embedding request)."""
        outputs = self.engine.generate(request_id, prompt_ids, SamplingParams(max_tokens=0), embed=True)
        async with aclosing(outputs):  # closing it aborts the request (a client gone)
            with _bad_input_is_400():
                out, _ = await collect(outputs)
        if out.embedding is None:  # aborted (by an admin's /abort_request)
            raise APIError(409, "the embedding request was aborted")
        return out.embedding

    async def _prefill_state(self, request_id: str, prompt_ids: list[int]) -> Any:
        """The state of a sequence after `prompt_ids` (an engine `SequenceState`), from an internal
        request of one token (no client's: outside the request metrics and token counts)."""
        params = SamplingParams(max_tokens=1, temperature=0)
        outputs = self.engine.generate(request_id, prompt_ids, params, capture_state=True, internal=True)
        with _bad_input_is_400():
            out, _ = await collect(outputs)
        return out.state


def message_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for message in messages for v in message.values())


def _longest_token(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest entry: no token's text is longer (a byte-level
    entry has a character per byte)."""
    return max(map(len, tokenizer.get_vocab()), default=1) if tokenizer is not None else 1


def _render_and_encode(encoder: PromptEncoder, messages: list[dict[str, Any]], template_options: dict[str, Any]) -> list[int]:
    try:
        text = encoder.tokenizer.apply_chat_template(messages, tokenize=False, **template_options)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
    return encoder.encode(text)


@contextlib.contextmanager
def _bad_input_is_400() -> Iterator[None]:
    """Bad input (the engine and SamplingParams raise ValueError) is answered with 400."""
    try:
        yield
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def _started(start: asyncio.Future[RequestOutputs], shared_len: int) -> RequestOutputs:
    """The outputs of a choice whose start may still be pending; closing this aborts it either way.
    The `shared_len` tokens of the choices' shared prefill were computed for this request, so they
    are not reported as cached."""
    try:
        stream = await start
    finally:
        start.cancel()  # a no-op once it has started
    async with aclosing(stream):
        async for out in stream:
            yield dataclasses.replace(out, num_cached_tokens=out.num_cached_tokens - shared_len) if shared_len else out


def _nth_choice(params: SamplingParams, i: int) -> SamplingParams:
    return params if params.seed is None or i == 0 else dataclasses.replace(params, seed=(params.seed + i) % SEED_RANGE)


async def _timed(outputs: RequestOutputs, first: RequestOutput, timer: RequestTimer) -> RequestOutputs:
    async with aclosing(outputs):  # closing this generator aborts the request
        out = first
        while True:
            timer.observe(out)
            yield out
            if out.finished:
                return
            out = await anext(outputs)


async def _admitting(outputs: RequestOutputs, cache: PrefixCache) -> RequestOutputs:
    """The outputs as they come; the prompt's state goes into the prefix cache once it is there."""
    async with aclosing(outputs):
        async for out in outputs:
            if out.prompt_state is not None:
                await asyncio.to_thread(cache.admit, out.prompt_state)
            yield out


async def collect(outputs: AsyncIterator[RequestOutput]) -> tuple[RequestOutput, list[TokenLogprob]]:
    """Drain a request: its final output and the logprobs of all its tokens."""
    logprobs: list[TokenLogprob] = []
    async for out in outputs:
        logprobs += out.logprobs or []
    return out, logprobs


async def collect_choices(streams: list[RequestOutputs]) -> list[tuple[RequestOutput, list[TokenLogprob]]]:
    """`collect` for every choice at once; one that fails aborts the others."""
    if len(streams) == 1:
        return [await collect(streams[0])]
    drains = [asyncio.ensure_future(collect(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*drains))
    finally:
        for drain in drains:
            drain.cancel()


async def interleave(streams: list[RequestOutputs]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(choice index, output) from every stream as they come; closing this closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]):
            async for out in streams[0]:
                yield 0, out
        return
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    yielding: int | None = None
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for step in done:
                i = pending.pop(step)
                try:
                    out = step.result()
                except StopAsyncIteration:
                    continue
                yielding = i
                yield i, out
                yielding = None
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:  # closed early: a choice waiting for its next output is aborted by the cancellation,
        # one that has just given one by closing its stream
        for step, i in pending.items():
            if step.done():
                await streams[i].aclose()
            else:
                step.cancel()
        if yielding is not None:
            await streams[yielding].aclose()


def get_serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving
