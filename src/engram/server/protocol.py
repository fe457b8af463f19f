"""Request and response bodies: OpenAI's (chat, completions, models) and SGLang's (`/generate`).

Requests validate strictly (no "5" for 5). OpenAI's bodies ignore unknown fields, as vLLM does;
every field vLLM knows is either honoured or refused with a 400 naming it (`_UNSUPPORTED`:
accepted only at its no-op value). SGLang's `/generate` refuses unknown keys, at the top level and
in `sampling_params`, where an unknown key is usually a misspelled one (`max_tokens` for
`max_new_tokens`). Each request maps its fields to `SamplingParams` names in `sampling_fields()`;
`None` means "the engine's default".
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeAlias

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    Strict,
    model_serializer,
    model_validator,
)

from engram.engine.request import RequestOutput, StructuredOutputsParams
from engram.server.tools import (
    DeltaToolCall,
    FunctionDefinition,
    FunctionName,
    ToolCallMessage,
    ToolChoice,
    ToolDefinition,
    resolve_tools,
    template_tool_calls,
    tool_grammar,
)

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's from Python 3.13; mypy's stubs carry it

MAX_CHOICES = 64  # OpenAI's `n`: each choice is its own engine request
MAX_PROMPTS = 64  # a batch of prompts on /v1/completions, /generate and /v1/embeddings
# vLLM's older constrained-decoding fields and SGLang's (on OpenAI routes: regex, ebnf): the
# structured-outputs key each one stands for.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "regex": "regex",
    "ebnf": "grammar",
}
# SGLang's constrained-decoding fields of /generate's sampling_params: the structured-outputs key of each.
NATIVE_CONSTRAINT_FIELDS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
# Arguments of `apply_chat_template` that a request's chat_template_kwargs may not set (its own
# template, other messages or tools, tokenization, or the fields that have names of their own).
TEMPLATE_RESERVED_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "tokenize",
        "return_dict",
        "return_tensors",
        "add_generation_prompt",
        "continue_final_message",
        "tokenizer_kwargs",
    }
)
# logit_bias maps token ids to biases; JSON object keys are strings ("50256"), so they are parsed.
LogitBias = dict[Annotated[int, Strict(False)], float]
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,256}$"  # visible ASCII, as a header value can carry it; anchored: pydantic searches


Prompt: TypeAlias = str | list[int]  # one prompt: text or token ids


def is_prompt_batch(prompt: Prompt | list[str] | list[list[int]]) -> TypeIs[list[str] | list[list[int]]]:
    """A list of strings or of token-id lists, not one prompt (a string or token ids; [] is an empty one)."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def prompt_batch(prompt: Prompt | list[str] | list[list[int]]) -> Sequence[Prompt]:
    """A request's prompts: its batch, or its one prompt in a list."""
    return prompt if is_prompt_batch(prompt) else [prompt]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True)
    # Keys of the peers' bodies that this server does not honour: accepted only at their no-op value
    # (key: that value; None too), then dropped, else refused naming them.
    _UNSUPPORTED: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported_features(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls._UNSUPPORTED:
            return data
        used = [name for name, no_op in cls._UNSUPPORTED.items() if data.get(name) not in (None, no_op)]
        if used:
            raise ValueError(f"{', '.join(used)}: not supported by this server")
        return {key: value for key, value in data.items() if key not in cls._UNSUPPORTED}


def _no_conversation(value: object) -> object:
    if value is not None:
        raise ValueError("server-side conversations are on /v1/chat/completions")
    return value


# `conversation_id` on a route without conversations: any value but null is refused, saying where they are.
ConversationIdElsewhere: TypeAlias = Annotated[None, BeforeValidator(_no_conversation)]


# ---- OpenAI requests ------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` object (one key of json, regex, choice, grammar, json_object)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def params(self) -> StructuredOutputsParams:
        keys: dict[str, Any] = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object or None,
        }
        given = [key for key, value in keys.items() if value is not None]
        source = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
        return StructuredOutputsParams(**keys, disable_any_whitespace=self.disable_any_whitespace, source=source)


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(strict=True, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True, source="response_format")
        if self.json_schema is not None:
            return StructuredOutputsParams(json=self.json_schema.schema_, source="response_format.json_schema.schema")
        return None


def _field_constraints(request: BaseModel, fields: dict[str, str], prefix: str = "") -> list[StructuredOutputsParams]:
    """The constraints the request's `fields` (field name -> structured-outputs key) give, each
    named `prefix` + its field in errors."""
    return [
        StructuredOutputsParams(**{key: getattr(request, name)}, source=prefix + name)
        for name, key in fields.items()
        if getattr(request, name) is not None
    ]


def only_one_constraint(found: list[StructuredOutputsParams]) -> StructuredOutputsParams | None:
    if len(found) > 1:
        raise ValueError(f"give at most one output constraint; got {', '.join(p.source for p in found)}")
    return found[0] if found else None


class _OpenAIRequest(_Request):
    model: str | None = None  # None: the served model
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: LogitBias | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # structured outputs: OpenAI's, vLLM's, and the older fields (GUIDED_FIELDS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: Any = None  # SGLang's /generate name; refused here, where response_format says it
    _structured: StructuredOutputsParams | None = PrivateAttr(default=None)
    min_tokens: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=256)  # the response's id, as vLLM
    user: str | None = None  # OpenAI's end-user tag: vLLM takes it and does nothing with it, nor does this server
    best_of: int | None = None  # only as many as n
    # vLLM's features this server lacks
    _UNSUPPORTED: ClassVar[dict[str, Any]] = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "truncate_prompt_tokens": None,
        "spaces_between_special_tokens": True,
        "logits_processors": None,
        "return_tokens_as_token_ids": False,
        "return_token_ids": False,
        "priority": 0,
        "cache_salt": None,
        "kv_transfer_params": None,
        "vllm_xargs": None,
        "mm_processor_kwargs": None,
    }

    @model_validator(mode="after")
    def _one_output_constraint(self) -> _OpenAIRequest:
        if self.json_schema is not None:
            raise ValueError(
                "json_schema: send response_format {'type': 'json_schema', 'json_schema': {'schema': ...}} or structured_outputs {'json': ...}"
            )
        found = [
            p
            for p in (
                self.response_format.params() if self.response_format else None,
                self.structured_outputs.params() if self.structured_outputs else None,
            )
            if p is not None
        ]
        self._structured = only_one_constraint(found + _field_constraints(self, GUIDED_FIELDS))
        return self

    @model_validator(mode="after")
    def _best_of_is_n(self) -> _OpenAIRequest:
        if self.best_of not in (None, self.n):
            raise ValueError("best_of: not supported by this server (unless equal to n)")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream=true (as vLLM)")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _common_fields(self) -> dict[str, Any]:
        names = (
            "temperature",
            "top_p",
            "stop",
            "seed",
            "frequency_penalty",
            "presence_penalty",
            "logit_bias",
            "top_k",
            "min_p",
            "repetition_penalty",
            "ignore_eos",
            "stop_token_ids",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "min_tokens",
            "prompt_logprobs",
            "allowed_token_ids",
            "bad_words",
        )
        return {**{name: getattr(self, name) for name in names}, "structured_outputs": self._structured}


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it (content parts joined into one string, tool call
        arguments as objects)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls([(c.id, c.function.name, c.function.arguments) for c in self.tool_calls])
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class _ChatTemplateOptions(_Request):
    """vLLM's chat template options."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _template_options_agree(self) -> _ChatTemplateOptions:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt=false")
        reserved = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_RESERVED_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server renders its own template")
        return self

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of the chat template beyond the messages."""
        options = {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt}
        if self.continue_final_message:
            options["continue_final_message"] = True
        return options


class _ChatExtras(_Request):
    """vLLM's chat fields beyond the template options that this server does not honour."""

    chat_template: str | None = None
    echo: bool | None = None
    add_special_tokens: bool | None = None
    documents: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _no_own_template(self) -> _ChatExtras:
        if self.chat_template is not None:
            raise ValueError(
                "chat_template: a request's own chat template is refused (as vLLM does without "
                "--trust-request-chat-template); the checkpoint's template renders the messages"
            )
        used = [name for name, no_op in (("echo", False), ("add_special_tokens", False)) if getattr(self, name) not in (None, no_op)]
        used += ["documents"] if self.documents is not None else []
        if used:
            raise ValueError(f"{', '.join(used)}: not supported by this server")
        return self


class ChatCompletionRequest(_OpenAIRequest, _ChatTemplateOptions, _ChatExtras):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    functions: list[FunctionDefinition] | None = None  # the deprecated form of tools
    function_call: Literal["none", "auto"] | FunctionName | None = None
    parallel_tool_calls: bool = True  # false: at most one call (the grammar of "required"; the first call read under "auto")
    _tools: list[ToolDefinition] = PrivateAttr(default_factory=list)
    _tool_choice: ToolChoice = PrivateAttr(default="none")
    # Engram's extensions: continue a server-side conversation (send only the new messages).
    conversation_id: str | None = None
    branch: str | None = None
    from_turn: int | None = Field(default=None, ge=1)
    from_conversation: str | None = None  # start a new conversation from turn from_turn of this one (--enable-cross-session-refs)
    turn_id: str | None = Field(default=None, pattern=IDEMPOTENCY_KEY_PATTERN)  # the Idempotency-Key header's body form
    expected_turn: int | None = Field(default=None, ge=0)  # the branch's latest turn as the client knows it (0: none)

    @model_validator(mode="after")
    def _conversation_fields_need_an_id(self) -> ChatCompletionRequest:
        given = [name for name in ("branch", "from_turn", "from_conversation", "turn_id", "expected_turn") if getattr(self, name) is not None]
        if self.conversation_id is None and given:
            raise ValueError(f"{', '.join(given)} need a conversation_id")
        if self.conversation_id is None and 0 in (self.max_tokens, self.max_completion_tokens):
            raise ValueError("max_tokens 0 appends the messages to a conversation without generating: it needs a conversation_id")
        if self.conversation_id is not None and self.n != 1:
            raise ValueError("a conversation turn has one answer: n must be 1 with a conversation_id")
        if self.conversation_id is not None and (not self.add_generation_prompt or self.continue_final_message):
            raise ValueError(
                "a conversation turn renders its own template delta: add_generation_prompt and "
                "continue_final_message are for requests without a conversation_id"
            )
        return self

    @model_validator(mode="after")
    def _resolve_tools(self) -> ChatCompletionRequest:
        self._tools, self._tool_choice = resolve_tools(self.tools, self.tool_choice, self.functions, self.function_call)
        grammar = tool_grammar(self._tools, self._tool_choice, self.parallel_tool_calls)
        if grammar is not None:
            self._structured = only_one_constraint([p for p in (self._structured, grammar) if p is not None])
        return self

    def tool_setup(self) -> tuple[list[ToolDefinition], ToolChoice]:
        """The tools and the tool choice, the deprecated fields mapped to them."""
        return self._tools, self._tool_choice

    def chat_template_options(self) -> dict[str, Any]:
        """`template_options()` with the tools, which the chat template renders."""
        tools = {"tools": [t.model_dump(exclude_none=True) for t in self._tools]} if self._tools else {}
        return {**self.template_options(), **tools}

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def sampling_fields(self) -> dict[str, Any]:
        return {
            **self._common_fields(),
            "max_tokens": self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
        }


class CompletionRequest(_OpenAIRequest):
    # one prompt (text or token ids) or a batch of them: the choices are prompt-major (prompt i, choice j: i * n + j)
    prompt: (
        str
        | list[int]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = None
    echo: bool = False  # the prompt before the completion (with logprobs: its tokens' logprobs first)
    add_special_tokens: bool = True
    conversation_id: ConversationIdElsewhere = None
    _UNSUPPORTED: ClassVar[dict[str, Any]] = {**_OpenAIRequest._UNSUPPORTED, "suffix": None}

    @model_validator(mode="after")
    def _nothing_to_answer(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing; it is for echo=true (the prompt's logprobs)")
        return self

    @property
    def prompts(self) -> Sequence[Prompt]:
        return prompt_batch(self.prompt)

    def sampling_fields(self) -> dict[str, Any]:
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else self.prompt_logprobs
        return {**self._common_fields(), "max_tokens": self.max_tokens, "logprobs": self.logprobs, "prompt_logprobs": prompt_logprobs}


class TokenizeRequest(_ChatTemplateOptions):
    """vLLM's `/tokenize`: a prompt, or chat messages rendered by the chat template (with the
    template options of a chat request)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- OpenAI responses -----------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, *outs: RequestOutput) -> Usage:
        """The usage of one prompt's choices: the prompt counted once, every choice's tokens."""
        prompt, completion = len(outs[0].prompt_token_ids), sum(len(out.token_ids) for out in outs)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=outs[0].num_cached_tokens),
        )

    @classmethod
    def total(cls, outs: list[RequestOutput], n: int) -> Usage:
        """The usage of a batch of prompts, n choices each (prompt-major)."""
        parts = [cls.of(*outs[i : i + n]) for i in range(0, len(outs), n)]
        prompt, completion = sum(u.prompt_tokens for u in parts), sum(u.completion_tokens for u in parts)
        cached = sum(u.prompt_tokens_details.cached_tokens for u in parts)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's entry of a token in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None  # 1 for the most likely token
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # per prompt token: token id -> entry (None for the first)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCallMessage] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k == "content"}


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop string or token id that ended it (None for EOS, as vLLM)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it (None for EOS, as vLLM)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it (None for EOS, as vLLM)
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("prompt_logprobs") is None:
            data.pop("prompt_logprobs", None)
        return data


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ConversationFields(BaseModel):
    """Where a conversation request's turn went (Engram's extension; absent otherwise)."""

    conversation_id: str | None = None
    branch: str | None = None
    turn: int | None = None
    epoch: str | None = None  # the server's, new at every start: a client sees a restart
    _DROP_IF_UNSET: ClassVar[tuple[str, ...]] = ("conversation_id", "branch", "turn", "epoch")

    @model_serializer(mode="wrap")
    def _drop_unset_conversation(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in self._DROP_IF_UNSET:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatCompletionResponse(_Response, ConversationFields):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    _DROP_IF_UNSET: ClassVar[tuple[str, ...]] = (*ConversationFields._DROP_IF_UNSET, "prompt_logprobs")


class ChatCompletionChunk(_Response, ConversationFields):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None  # None on stream chunks


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "engram"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EmbeddingRequest(_Request):
    """OpenAI's `/v1/embeddings`: the mean of each input's last hidden states."""

    model: str | None = None
    input: (
        str
        | list[int]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's own (an embedding is not truncated)
    user: str | None = None  # as on the other routes: taken, no effect
    conversation_id: ConversationIdElsewhere = None

    @property
    def inputs(self) -> Sequence[Prompt]:
        return prompt_batch(self.input)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# ---- SGLang-native --------------------------------------------------------------------------


class NativeSamplingParams(_Request):
    model_config = ConfigDict(strict=True, extra="forbid")

    max_new_tokens: int | None = 128
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None  # SGLang's include_stop_str_in_output
    sampling_seed: int | None = None
    logit_bias: LogitBias | None = None
    min_new_tokens: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # results for a prompt: prompt-major in a batch, as SGLang
    # SGLang's structured outputs (at most one): a JSON schema (its JSON text), a regex, an EBNF grammar
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    _structured: StructuredOutputsParams | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_output_constraint(self) -> NativeSamplingParams:
        self._structured = only_one_constraint(_field_constraints(self, NATIVE_CONSTRAINT_FIELDS, "sampling_params."))
        return self


class AbortRequest(_Request):
    rid: str | None = Field(default=None, min_length=1, max_length=256)
    abort_all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortRequest:
        if (self.rid is None) == (not self.abort_all):
            raise ValueError("send a rid, or abort_all=true")
        return self


Rid = Annotated[str, Field(min_length=1, max_length=256)]


class GenerateRequest(_Request):
    """SGLang's `/generate`: one prompt or a batch (a list of texts or of token-id lists), whose
    results come as a list, prompt-major with sampling_params.n each."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None  # not SGLang's, but clients of both APIs send it: the served model, if given
    text: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | None = None
    input_ids: list[int] | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: Rid | list[Rid] | None = None  # a batch's: one per prompt
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    conversation_id: ConversationIdElsewhere = None
    # SGLang's fields this server lacks
    _UNSUPPORTED: ClassVar[dict[str, Any]] = {
        "lora_path": None,
        "lora_id": None,
        "custom_logit_processor": None,
        "input_embeds": None,
        "image_data": None,
        "audio_data": None,
        "video_data": None,
        "session_params": None,
        "return_hidden_states": False,
        "logprob_start_len": -1,
        "token_ids_logprob": None,
        "data_parallel_rank": None,
        "bootstrap_host": None,
        "bootstrap_room": None,
    }

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if isinstance(self.rid, list) and (not self.is_batch or len(self.rid) != len(self.prompts)):
            raise ValueError("rid: a list of rids is for a batch, one per prompt")
        return self

    @property
    def _given(self) -> Prompt | list[str] | list[list[int]]:
        """`text` or `input_ids`, whichever was given (`_one_prompt` checks that one was)."""
        given = self.text if self.text is not None else self.input_ids
        assert given is not None
        return given

    @property
    def is_batch(self) -> bool:
        """A list of prompts: the response is a list too."""
        return is_prompt_batch(self._given)

    @property
    def prompts(self) -> Sequence[Prompt]:
        return prompt_batch(self._given)

    def sampling_fields(self) -> dict[str, Any]:
        fields = self.sampling_params.model_dump(
            exclude={"max_new_tokens", "sampling_seed", "no_stop_trim", "n", "json_schema", "regex", "ebnf", "min_new_tokens"}
        )
        return {
            **fields,
            "structured_outputs": self.sampling_params._structured,
            "max_tokens": self.sampling_params.max_new_tokens,
            "min_tokens": self.sampling_params.min_new_tokens,
            "seed": self.sampling_params.sampling_seed,
            "include_stop_str_in_output": self.sampling_params.no_stop_trim,
            "logprobs": self.top_logprobs_num if self.return_logprob else None,
        }


class MetaInfo(BaseModel):
    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None  # (logprob, token id, text if asked)
    output_top_logprobs: list[list[tuple[float, int, str | None]]] | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


# ---- snapshot routes (the SGLang-based predecessor's bodies) ----------------------------------


_SNAPSHOT_ID_RE = re.compile(r"(?:[^/]{1,128}/)?[0-9]{1,6}")  # "<branch>/<turn>" or "<turn>", ASCII digits


class _TurnSelector(_Request):
    """A turn of a conversation: `turn_number` on `branch_name`, or `snapshot_id` ("branch/000003"
    or "3"); the latest turn of the branch when neither is given."""

    turn_number: int | None = Field(default=None, ge=1)
    branch_name: str | None = None
    snapshot_id: str | None = None

    @model_validator(mode="after")
    def _snapshot_id_form(self) -> _TurnSelector:
        if self.snapshot_id is not None and not _SNAPSHOT_ID_RE.fullmatch(self.snapshot_id):
            raise ValueError(f"snapshot_id {self.snapshot_id!r:.80} is not '<branch>/<turn>' or '<turn>'")
        return self

    def target(self) -> tuple[str, int | None]:
        """(branch, turn); the branch is not checked here (the conversation manager validates it)."""
        default = self.branch_name if self.branch_name is not None else "main"
        if self.snapshot_id is None:
            return default, self.turn_number
        head, _, tail = self.snapshot_id.rpartition("/")
        return head or default, int(tail)


class SnapshotSelector(_TurnSelector):
    conversation_id: str


class SaveSnapshotRequest(_TurnSelector):
    conversation_id: str | None = None  # None: the conversation of the request `rid`
    rid: str | None = None

    @model_validator(mode="after")
    def _who(self) -> SaveSnapshotRequest:
        if self.conversation_id is None and self.rid is None:
            raise ValueError("give conversation_id or the rid of a finished conversation request")
        return self


class ListSnapshotsRequest(_Request):
    conversation_id: str | None = None


class RestoreSnapshotRequest(SnapshotSelector):
    rid: str | None = Field(default=None, min_length=1, max_length=256)
    create_new_request: bool = False
    continuation_ids: list[int] | None = None
    max_new_tokens: int | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False

    @model_validator(mode="after")
    def _one_answer(self) -> RestoreSnapshotRequest:
        if self.sampling_params.n != 1:
            raise ValueError("sampling_params.n: a restored conversation continues with one answer (n must be 1)")
        return self

    def sampling_fields(self) -> dict[str, Any]:
        fields = GenerateRequest(input_ids=[0], sampling_params=self.sampling_params).sampling_fields()
        if self.max_new_tokens is not None:
            fields["max_tokens"] = self.max_new_tokens
        return fields
