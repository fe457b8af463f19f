"""Conversation turns over HTTP: the chat-template delta of the new messages, appended to the
conversation's exact token history, and the turn recorded when the request finishes.

The `ConversationManager` (state/) holds histories and states; this module only moves token
ids, strings and the opaque state handle between it and the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from engram.args import ServerArgs
from engram.engine.async_engine import AsyncEngine, RequestOutputs
from engram.engine.engine import LLMEngine
from engram.engine.request import FinishReason, RequestOutput, SlotNotRetainedError
from engram.models.embedded import default_cache_dir
from engram.server.chat_reply import ReplyFormat
from engram.server.errors import APIError
from engram.server.tokens import encode
from engram.state.conversations import ConversationManager
from engram.state.health import HealthConfig, HealthMonitor, HealthPolicy
from engram.state.identity import ModelIdentity, tokenizer_fingerprint
from engram.state.object_store import StoreConfigError, local_folder, remote_url
from engram.state.store import WarmCache
from engram.state.tiers import SnapshotPolicy, SnapshotTrigger, TierConfig
from engram.state.turns import Turn, TurnAnswer, TurnPlan, retain_key

log = logging.getLogger(__name__)
RECENT_REQUESTS = 4096  # request ids remembered for /save_snapshot by rid
MAINTENANCE_PERIOD_S = 1.0
# Messages of the history's tail a new turn's template delta is rendered from: two windows that
# must agree (each starting at a user message in a user/assistant conversation).
TAIL_WINDOWS = (2, 4)


def build_manager(engine: LLMEngine, args: ServerArgs) -> ConversationManager:
    policy = SnapshotPolicy(SnapshotTrigger(args.snapshot_trigger_policy), args.snapshot_every_n_turns, args.snapshot_retention_count)
    tiers = TierConfig(
        enabled=args.enable_memory_tiers,
        active_timeout=args.conversation_active_timeout,
        warm_timeout=args.conversation_warm_timeout,
        cold_retention=args.conversation_cold_retention,
        durability=args.snapshot_durability,
    )
    root, store_url = None, remote_url(args.snapshot_store)
    if args.snapshot_store is not None and not args.enable_snapshot_persistence:
        raise StoreConfigError(f"--snapshot-store {args.snapshot_store}: snapshot persistence is off (--no-enable-snapshot-persistence)")
    if store_url is not None and args.snapshot_durability != "sync":
        raise StoreConfigError(
            f"--snapshot-store {store_url}: replicas sharing a store need --snapshot-durability sync "
            "(a turn answered before its record is written could be refused by another replica's)"
        )
    if args.enable_snapshot_persistence:
        root = Path(args.snapshot_dir) if args.snapshot_dir else default_cache_dir() / "snapshots"
        if args.snapshot_store is not None and store_url is None:
            root = local_folder(args.snapshot_store)
    warm_entries = args.max_warm_conversations if args.enable_memory_tiers else 0
    health = HealthMonitor(HealthConfig(args.snapshot_health_check_interval, HealthPolicy(args.snapshot_health_failure_policy)))
    return ConversationManager(
        engine.spec,
        engine.state_dtypes,
        ModelIdentity.of(engine.spec, engine.model_path),
        tokenizer_fingerprint(engine.model_path),
        policy,
        root,
        WarmCache(warm_entries, int(args.max_warm_memory_gb * (1 << 30))),
        tiers,
        health=health,
        chunk_tokens=args.state_chunk_tokens,
        prefix_cache_bytes=int(args.prefix_cache_memory_gb * (1 << 30)) if args.enable_prefix_caching else 0,
        prefix_cache_min_tokens=args.prefix_cache_min_tokens,
        prefix_cache_disk_bytes=int(args.prefix_cache_disk_gb * (1 << 30)),
        store_url=store_url,
        staging_device=engine.restore_device,
        host_arena_bytes=int(args.pinned_load_memory_gb * (1 << 30)),
    )


# Stands in for a reply's text when rendering where the template closes it (no spaces or markup
# for a template to trim or escape).
REPLY_MARKER = "engramReplyMarker7f3a"


def new_messages(history: list[dict[str, Any]], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages a turn adds: past the stored history when the request repeats it first (a
    client that sends the whole conversation every time). One message is always new; a request
    that repeats only part of the history, or nothing past it, is ambiguous (400)."""
    if len(messages) == 1 or not history:
        return messages
    same = next((i for i, (a, b) in enumerate(zip(history, messages)) if a != b), min(len(history), len(messages)))
    if same == 0:
        return messages
    if same == len(history) < len(messages):
        return messages[same:]
    how = "and add nothing" if same == len(messages) else f"but message {same} differs from it"
    raise APIError(
        400,
        f"the messages repeat the first {same} of the conversation's {len(history)} stored messages {how}: "
        "send only the new messages, or the whole stored history followed by them",
        param="messages",
    )


async def run_maintenance(manager: ConversationManager, engine: AsyncEngine, period: float = MAINTENANCE_PERIOD_S) -> None:
    """Demote idle states and expire old conversations, releasing engine slots that went idle."""
    while True:
        await asyncio.sleep(period)
        try:
            for key in await asyncio.to_thread(manager.maintain):
                await engine.release_retained(key)
        except Exception:
            log.exception("state maintenance failed")


@dataclass
class ConversationTurns:
    manager: ConversationManager
    tokenizer: Any
    by_request: OrderedDict[str, tuple[str, str, int]] = field(default_factory=OrderedDict)  # rid -> (conversation, branch, turn)
    cross_session_refs: bool = True  # --enable-cross-session-refs

    async def begin(
        self,
        conversation_id: str,
        branch: str | None,
        from_turn: int | None,
        tenant: str | None = None,
        idempotency_key: str | None = None,
        expected_turn: int | None = None,
        from_conversation: str | None = None,
    ) -> TurnPlan | Turn:
        """Reserve the conversation and plan the turn, off the event loop (it may read a snapshot
        file); or the turn that `idempotency_key` already made (`ConversationManager.begin`). If
        the request is cancelled meanwhile (its client left), the thread still finishes and the
        conversation it reserved is released then."""
        branch = branch if branch is not None else "main"
        if from_conversation is not None and not self.cross_session_refs:
            raise APIError(
                400,
                "from_conversation needs a server started with --enable-cross-session-refs",
                param="from_conversation",
                code="cross_session_refs_disabled",
            )
        work = asyncio.ensure_future(
            asyncio.to_thread(self.manager.begin, conversation_id, branch, from_turn, tenant, idempotency_key, expected_turn, from_conversation)
        )
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(self._release_unused)
            raise

    def _release_unused(self, work: asyncio.Future[TurnPlan | Turn]) -> None:
        if not work.cancelled() and work.exception() is None and isinstance(plan := work.result(), TurnPlan):
            self.manager.release(plan.conversation_id)

    def replay(self, conversation_id: str, turn: Turn, messages: list[dict[str, Any]]) -> RequestOutput:
        """The answer of a turn made by a request with the same idempotency key, as its output was
        (without logprobs). The retry must send the same messages (alone, or after the history)."""
        conv = self.manager.require(conversation_id)
        answer = turn.answer
        assert answer is not None, "the turn was found by its answer's idempotency key"
        parent = conv.turns[turn.parent] if turn.parent is not None else None
        sent = turn.new_messages[:-1] if answer.completion_tokens else turn.new_messages
        if messages not in (sent, conv.messages(parent) + sent):
            raise APIError(
                422,
                f"this Idempotency-Key made turn {turn.turn} of conversation {conversation_id!r} with other messages",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
        tokens = conv.tokens(turn)
        prompt, reply = tokens[: len(tokens) - answer.completion_tokens], tokens[len(tokens) - answer.completion_tokens :]
        text = (answer.text if answer.text is not None else turn.new_messages[-1]["content"]) if answer.completion_tokens else ""
        return RequestOutput(
            request_id="",
            prompt_token_ids=prompt,
            token_ids=reply,
            text=text,
            new_token_ids=reply,
            new_text=text,
            finished=True,
            finish_reason=FinishReason(answer.finish_reason),
            stop_reason=answer.stop_reason,
            num_cached_tokens=answer.cached_tokens,
        )

    def engine_kwargs(self, plan: TurnPlan) -> dict[str, Any]:
        """How the engine should start the turn: the state to restore (or the slot to adopt: the
        engine refuses with SlotNotRetainedError if it is gone, see `start`), and to capture the
        final state (and keep its slot, when the memory tiers are on)."""
        kwargs: dict[str, Any] = {
            "initial_state": plan.state,
            "capture_state": True,
            "resume_key": plan.resume_key,
            "require_adoption": plan.resume_key is not None and plan.state is None,
            "host_base": plan.host_base,
            "staged": plan.staging,
        }
        if self.manager.tiers.enabled:
            kwargs["retain_key"] = retain_key(plan.conversation_id, plan.ref)
        return kwargs

    async def start(self, plan: TurnPlan, generate: Callable[..., Awaitable[RequestOutputs]]) -> RequestOutputs:
        """Start the turn's request with `generate(**engine_kwargs)`. If the slot `begin` found
        was reclaimed before the engine came to adopt it, the state the turn falls back to is
        fetched only then (off the event loop: it may read a snapshot) and the request starts from it."""
        try:
            return await generate(**self.engine_kwargs(plan))
        except SlotNotRetainedError:
            await asyncio.to_thread(self.manager.fall_back, plan)
            return await generate(**self.engine_kwargs(plan))

    def prompt(self, plan: TurnPlan, new_messages: list[dict[str, Any]], generate: bool = True, options: dict[str, Any] | None = None) -> list[int]:
        """The history's exact tokens followed by the template rendering of only the new messages
        (and the generation prompt, unless the turn only appends them). The template is rendered
        over the last messages only (O(new tokens), not O(history)) when two windows of them give
        the same text (`_tail_delta`); else over the whole conversation. `options`: the template's
        variables (the tools, chat_template_kwargs), the same for every rendering of the turn."""
        if self.tokenizer is None:
            raise APIError(400, "the model has no tokenizer: conversations need a chat template")
        options = {k: v for k, v in (options or {}).items() if k != "add_generation_prompt"}
        if not plan.history_messages:
            return encode(self.tokenizer, self._render(new_messages, generate, options), add_special_tokens=False)
        delta = self._tail_delta(plan, new_messages, generate, options)
        if delta is None:
            delta = self._delta(plan.history_messages, new_messages, plan, generate, options)
        return plan.history_tokens + encode(self.tokenizer, delta, add_special_tokens=False)

    def _delta(
        self, history: list[dict[str, Any]], new_messages: list[dict[str, Any]], plan: TurnPlan, generate: bool, options: dict[str, Any] | None = None
    ) -> str:
        """What the history's rendering lacks of the conversation's: the last reply's closing the
        model did not generate (if the history ends with a reply), then the new messages and the
        generation prompt."""
        before = self._render(history, False, options)
        after = self._render(history + new_messages, generate, options)
        if not after.startswith(before):
            raise APIError(
                422, "the chat template does not render this conversation incrementally; send the whole conversation without conversation_id"
            )
        closing = self._unclosed_reply(history, plan.history_tokens, options) if plan.history_ends_with_reply else ""
        return closing + after[len(before) :]

    def _tail_delta(self, plan: TurnPlan, new_messages: list[dict[str, Any]], generate: bool, options: dict[str, Any]) -> str | None:
        """`_delta` from two windows of the history: its system message (if first) and its last 2,
        then its last 4 messages. Their agreement says the template renders the new messages
        without reading what lies before the window; None when they differ or one fails."""
        history = plan.history_messages
        head = history[:1] if history[0].get("role") == "system" else []
        deltas = []
        for size in TAIL_WINDOWS:
            if len(head) + size >= len(history):
                return None  # the windows are (nearly) the whole history: render it
            try:
                deltas.append(self._delta(head + history[-size:], new_messages, plan, generate, options))
            except APIError:
                return None
        return deltas[0] if all(d == deltas[0] for d in deltas) else None

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, options: dict[str, Any] | None = None) -> str:
        try:
            text: str = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **(options or {}))
            return text
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None

    def _unclosed_reply(self, messages: list[dict[str, Any]], history_tokens: list[int], options: dict[str, Any] | None = None) -> str:
        """What the template puts after the last reply that the model did not generate itself: it
        has to be fed before the new messages. The template's closing text is found after a marker
        rendered in the reply's place, whatever the reply's text (empty, or a piece of the
        template's own markup). Of it, the part the history already ends with is left out (an
        end-of-turn token the model generated, or a newline the template would trim), and after an
        end token the model generated on its own, what precedes that token in the closing too."""
        *earlier, reply = messages
        rendering = self._render(earlier + [{**reply, "content": REPLY_MARKER}], False, options)
        at = rendering.rfind(REPLY_MARKER)
        closing = rendering[at + len(REPLY_MARKER) :] if at >= 0 else ""
        ids = encode(self.tokenizer, closing, add_special_tokens=False)
        history = history_tokens
        done = next((k for k in range(min(len(ids), len(history)), 0, -1) if history[-k:] == ids[:k]), 0)
        if not done and history and history[-1] in self.tokenizer.all_special_ids and history[-1] in ids:
            done = ids.index(history[-1]) + 1
        fed = self.tokenizer.decode(ids[:done], skip_special_tokens=False)
        return closing[len(fed) :] if closing.startswith(fed) else closing

    async def record(
        self,
        rid: str,
        plan: TurnPlan,
        new_messages: list[dict[str, Any]],
        outputs: RequestOutputs,
        reply: ReplyFormat | None = None,
    ) -> RequestOutputs:
        """Pass the outputs through, recording the turn before its final output goes on: a client
        that has read the end of a reply holds a recorded turn (on disk, with sync durability), and
        a record that fails is the request's error in its place. An aborted or failed request
        records nothing and frees the conversation."""
        last: RequestOutput | None = None
        recording = False
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    if last is None and plan.state_tier is not None:
                        self.manager.stats.restore_seconds[plan.state_tier].observe(plan.load_seconds + out.restore_seconds)
                    last = out
                    if out.finished and out.finish_reason != FinishReason.ABORT:  # without a state if preempted at its end
                        recording = True  # from here on `finish` frees the conversation, whatever happens
                        turn = await self.finish(plan, new_messages, out, reply or ReplyFormat())
                        self.by_request[rid] = (plan.conversation_id, turn.branch, turn.turn)
                        while len(self.by_request) > RECENT_REQUESTS:
                            self.by_request.popitem(last=False)
                    yield out
        finally:
            if not recording:
                self.manager.release(plan.conversation_id)

    async def finish(self, plan: TurnPlan, new_messages: list[dict[str, Any]], out: RequestOutput, fmt: ReplyFormat) -> Turn:
        """Record the turn in a task of the server's own: a client that leaves meanwhile (which
        cancels its request) neither stops the record nor leaves the conversation reserved. A turn
        that generated nothing records no reply; a reply is recorded as the message a client sends
        back (its tool calls, without its reasoning), and its calls are what `on_tool_call` looks for."""
        reply = fmt.read(out.text) if out.token_ids else None
        messages = new_messages + ([reply.message()] if reply is not None else [])
        parsed = reply is not None and reply.content != out.text
        reason = out.finish_reason.value if out.finish_reason is not None else None
        answer = TurnAnswer(plan.idempotency_key, reason, out.stop_reason, len(out.token_ids), out.num_cached_tokens, out.text if parsed else None)
        work = asyncio.ensure_future(
            asyncio.to_thread(
                self.manager.finish,
                plan,
                out.prompt_token_ids,
                out.token_ids,
                messages,
                out.state,
                reply is not None and bool(reply.calls),
                answer,
                out.retained,
            )
        )
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(_log_unheard_failure)
            raise


def _log_unheard_failure(work: asyncio.Future[Turn]) -> None:
    """A turn's record failed after its client left: nobody else hears of it."""
    if not work.cancelled() and work.exception() is not None:
        log.warning("a turn whose client had left was not recorded: %s", work.exception())
