"""Request bodies that pass the server's cross-field checks, with every optional field fuzzed.

The OpenAPI schema cannot say "exactly one of text and input_ids" or "n must be 1 with a
conversation_id", so most of schemathesis' positive bodies stop at validation. These reach the
engine and the conversation store: sampling values at and past their edges, token ids past the
vocabulary, stop strings and token ids, zero and negative lengths, streams, the shared
conversations continued from any turn.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

Body = st.SearchStrategy[dict]
CONVERSATIONS = ("fuzz-a", "fuzz-b", "fuzz-c")  # shared by the cases, so that later ones find earlier ones' turns
MAX_TOKENS = 24  # replies stay short: the run's time goes to many cases, not long ones

_texts = st.text(max_size=40)
_small_text = st.text(max_size=8)
_tokens = st.integers(-3, 300) | st.integers()  # the test checkpoints' vocabularies end near 280
_token_lists = st.lists(_tokens, max_size=24)
_floats = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-3, 3)
_lengths = st.none() | st.integers(-2, MAX_TOKENS)
_stops = st.none() | _small_text | st.lists(_small_text, max_size=3)
_conversations = st.sampled_from(CONVERSATIONS) | st.text(min_size=1, max_size=12)
_turns = st.none() | st.integers(-1, 8)

_SAMPLING = {
    "temperature": st.none() | st.sampled_from([0, 0.0, 1e-9, 0.7, 2.0]) | _floats,
    "top_p": st.none() | _floats,
    "top_k": st.none() | st.integers(-2, 300) | st.integers(),
    "min_p": st.none() | _floats,
    "frequency_penalty": st.none() | _floats,
    "presence_penalty": st.none() | _floats,
    "repetition_penalty": st.none() | _floats,
    "stop": _stops,
    "stop_token_ids": st.none() | _token_lists,
    "ignore_eos": st.none() | st.booleans(),
    "skip_special_tokens": st.none() | st.booleans(),
    "logit_bias": st.none() | st.dictionaries(_tokens.map(str), _floats, max_size=3),
}
_OPENAI = {
    **_SAMPLING,
    "seed": st.none() | st.integers(),
    "stream": st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
}
_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
            "content": st.none() | _texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _texts}), max_size=2),
        }
    ),
    min_size=1,
    max_size=3,
)


def _chat(model: str) -> Body:
    plain = st.fixed_dictionaries(
        {"model": st.just(model), "messages": _messages},
        optional={**_OPENAI, "max_tokens": _lengths, "n": st.integers(1, 3), "logprobs": st.booleans(), "add_generation_prompt": st.booleans()},
    )
    turn = st.fixed_dictionaries(
        {"model": st.just(model), "messages": _messages, "conversation_id": _conversations},
        optional={
            **_OPENAI,
            "max_tokens": _lengths,
            "branch": st.none() | st.sampled_from(["main", "b"]) | _small_text,
            "from_turn": _turns,
            "logprobs": st.booleans(),
            "top_logprobs": st.none() | st.integers(-1, 25),
        },
    )
    return plain | turn


def _completion(model: str) -> Body:
    return st.fixed_dictionaries(
        {"model": st.just(model), "prompt": _texts | _token_lists},
        optional={**_OPENAI, "max_tokens": _lengths, "n": st.integers(1, 3), "logprobs": st.none() | st.integers(-1, 25)},
    )


_native_sampling = st.fixed_dictionaries({}, optional={**_SAMPLING, "max_new_tokens": _lengths, "sampling_seed": st.none() | st.integers()})


def _generate(_: str) -> Body:
    prompt = st.fixed_dictionaries({"text": _texts}) | st.fixed_dictionaries({"input_ids": _token_lists})
    rest = st.fixed_dictionaries(
        {},
        optional={
            "sampling_params": _native_sampling,
            "stream": st.booleans(),
            "return_logprob": st.booleans(),
            "top_logprobs_num": st.integers(-1, 25),
            "rid": st.text(min_size=1, max_size=8),
        },
    )
    return st.builds(lambda a, b: {**a, **b}, prompt, rest)


def _tokenize(model: str) -> Body:
    prompt = st.fixed_dictionaries({"prompt": _texts}, optional={"add_special_tokens": st.booleans()})
    chat = st.fixed_dictionaries({"messages": _messages}, optional={"add_generation_prompt": st.booleans()})
    return st.builds(lambda a, m: {**a, **m}, prompt | chat, st.sampled_from([{}, {"model": model}]))


_SELECTOR = {"conversation_id": _conversations}
_SELECTOR_OPTIONAL = {
    "turn_number": _turns,
    "branch_name": st.none() | st.sampled_from(["main", "b"]),
    "snapshot_id": st.none() | st.sampled_from(["1", "2", "main/000001", "b/2"]),
}


def _restore(_: str) -> Body:
    return st.fixed_dictionaries(
        _SELECTOR,
        optional={
            **_SELECTOR_OPTIONAL,
            "create_new_request": st.booleans(),
            "continuation_ids": st.none() | _token_lists,
            "max_new_tokens": _lengths,
            "sampling_params": _native_sampling,
            "stream": st.booleans(),
            "rid": st.text(min_size=1, max_size=8),
        },
    )


def _selected(_: str) -> Body:
    return st.fixed_dictionaries(_SELECTOR, optional=_SELECTOR_OPTIONAL)


BODIES: dict[str, Callable[[str], Body]] = {
    "POST /v1/chat/completions": _chat,
    "POST /v1/completions": _completion,
    "POST /generate": _generate,
    "POST /tokenize": _tokenize,
    "POST /detokenize": lambda model: st.fixed_dictionaries({"tokens": _token_lists}, optional={"model": st.just(model)}),
    "POST /restore_snapshot": _restore,
    "POST /save_snapshot": _selected,
    "POST /get_snapshot_info": _selected,
    "POST /delete_snapshot": _selected,
    "POST /abort_request": lambda _: st.fixed_dictionaries({"rid": st.text(min_size=1, max_size=8)}) | st.just({"abort_all": True}),
    "POST /list_snapshots": lambda _: st.fixed_dictionaries({}, optional={"conversation_id": _conversations}),
}
