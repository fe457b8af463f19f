"""Streamed chunks serialized once (`text_event`) against pydantic's serialization of each chunk."""

from __future__ import annotations

import pytest

from engram.server.protocol import ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse, DeltaMessage
from engram.server.streaming import TEXT_MARK, TextEvents, sse, text_event

TEXTS = [
    "a",
    " the",
    '"quoted"',
    "back\\slash",
    "tab\tnew\nline\r",
    "\x00\x01\x1f\x7f",
    "é",
    "日本語",
    "🙂",
    "\u2028\u2029",
    "\ufeff",
    "</script>",
    TEXT_MARK,
    "{}[],:",
]


def completion(model: str):
    return lambda text: CompletionResponse(id="cmpl-1", created=7, model=model, choices=[CompletionChoice(index=3, text=text)])


def chat(model: str):
    return lambda text: ChatCompletionChunk(
        id="chatcmpl-1",
        created=7,
        model=model,
        conversation_id="c",
        turn=2,
        epoch="e",
        choices=[ChatChunkChoice(index=0, delta=DeltaMessage(content=text))],
    )


@pytest.mark.parametrize("build", [completion("m"), chat("m")], ids=["completion", "chat"])
def test_a_text_event_is_the_chunk_pydantic_serializes(build):
    built = []
    event = text_event(lambda text: built.append(text) or build(text))
    for text in TEXTS + ["".join(TEXTS), "".join(map(chr, range(0x20)))]:
        assert event(text) == sse(build(text))
    assert built == [TEXT_MARK]  # serialized once, not per text


@pytest.mark.parametrize("build", [completion(f"name{TEXT_MARK}"), chat(TEXT_MARK)], ids=["completion", "chat"])
def test_a_mark_outside_the_text_falls_back_to_pydantic(build):
    event = text_event(build)
    assert event("x") == sse(build("x")) and TEXT_MARK in event("x")


def test_text_events_keep_each_choice_apart():
    events = TextEvents(lambda i, text: CompletionResponse(id="c", created=1, model="m", choices=[CompletionChoice(index=i, text=text)]))
    for i in (0, 5, 0):
        assert events(i, "hi") == sse(CompletionResponse(id="c", created=1, model="m", choices=[CompletionChoice(index=i, text="hi")]))
