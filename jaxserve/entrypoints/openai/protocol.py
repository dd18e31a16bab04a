"""Request and response bodies of the OpenAI API (the subset jaxserve serves), as pydantic models.

Unknown request fields are ignored, as OpenAI-compatible servers do. Every field of vLLM's
protocol is declared: those jaxserve does not support are listed in `UNSUPPORTED` with the values
that ask for nothing, and any other value is refused (a 400 naming the field), never ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidatorFunctionWrapHandler, WrapValidator, model_serializer,
                      model_validator)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


def _check_text(value: Any, where: str) -> None:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"): no tokenizer or reply can encode it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{where or 'body'}: text holds a lone surrogate at position "
                             f"{exc.start} (not valid Unicode)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, dict, list)):  # a long token id list: no call per id
                _check_text(item, f"{where}.{i}")


def _item(value: Any) -> Any:
    return value


# An item of a list that a body may hold millions of. Pydantic holds the GIL through a whole
# list (1.7 s for 270k chat messages), stalling the event loop even from a worker thread; a
# Python call per item lets the loop's thread take the GIL between two.
Item = BeforeValidator(_item)
TokenIds = list[Annotated[int, Item]]


class APIRequest(BaseModel):
    """A request body naming a model; `UNSUPPORTED` maps each field jaxserve does not support
    to the values that ask for nothing."""
    model_config = ConfigDict(extra="ignore")
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_text(data, "")
        return data

    model: str | None = None

    def unsupported_field(self) -> str | None:
        """The first field set to a value jaxserve would have to ignore, if any."""
        for name, no_effect in self.UNSUPPORTED.items():
            if getattr(self, name) not in no_effect:
                return name
        return None


class SamplingRequest(APIRequest):
    """Fields shared by completions and chat completions (extensions after the blank line)."""
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None
    return_token_ids: bool = False  # choices carry the generated token ids (vLLM's extension)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: all fit)
    request_id: str | None = None  # the response's id is built from it (as vLLM)

    # vLLM's fields that jaxserve does not support (see UNSUPPORTED).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    prompt_logprobs: int | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None
    logits_processors: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    # field -> the values that ask for nothing; any other value is answered with a 400.
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "use_beam_search": (False,), "length_penalty": (1.0,), "prompt_logprobs": (None,),
        "spaces_between_special_tokens": (True,),
        "return_tokens_as_token_ids": (None, False), "logits_processors": (None, []),
        "structural_tag": (None,), "guided_decoding_backend": (None, "guidance"),
        "guided_whitespace_pattern": (None,), "kv_transfer_params": (None,),
        "vllm_xargs": (None, {}),
    }

    def unsupported_field(self) -> str | None:
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            return "stream_options.continuous_usage_stats"
        return super().unsupported_field()


def _prompts(name: str) -> WrapValidator:
    """A field of one or more prompts (text or token ids), its shape checked in Python:
    pydantic's check of the union holds the GIL for seconds on a long token id list (1.5 s for
    3.5M ids), stalling the event loop even from a worker thread; a Python loop lets it run."""
    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, str):
            return handler(value)
        if isinstance(value, list) and (
                all(type(t) is int for t in value) or all(type(t) is str for t in value)
                or all(type(p) is list and all(type(t) is int for t in p) for p in value)):
            return value
        raise ValueError(f"{name}: must be a string, a list of strings, a list of token ids "
                         f"(integers) or a list of token id lists, got {_shape(value)}")
    return WrapValidator(check)


Prompts = str | list[str] | list[int] | list[list[int]]


def _shape(value: Any) -> str:
    if not isinstance(value, list):
        return type(value).__name__
    kinds = sorted({type(item).__name__ for item in value})
    return f"a list of {' and '.join(kinds)}"


class CompletionRequest(SamplingRequest):
    prompt: Annotated[Prompts, _prompts("prompt")]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    prompt_embeds: bytes | list[bytes] | None = None

    # prompt_logprobs is honoured here (not on chat): each choice carries the prompt's.
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        k: v for k, v in SamplingRequest.UNSUPPORTED.items() if k != "prompt_logprobs"} | {
        "suffix": (None, ""), "prompt_embeds": (None,)}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[Annotated[ChatMessage, Item]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: tool_choice "required" makes one call
    reasoning_effort: str | None = None
    include_reasoning: bool = True  # no effect: there is no reasoning parser
    echo: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = SamplingRequest.UNSUPPORTED | {
        "reasoning_effort": (None,),
        "echo": (False,), "add_special_tokens": (False,),
        "documents": (None, []), "chat_template": (None,),
        "mm_processor_kwargs": (None, {})}


class TokenizeCompletionRequest(APIRequest):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatTemplateRequest(APIRequest):
    """A body of messages rendered through the chat template to token ids (not a chat
    completion: /tokenize, /v1/embeddings)."""
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        name: ChatCompletionRequest.UNSUPPORTED[name] for name in (
            "add_special_tokens", "chat_template", "mm_processor_kwargs")}
    messages: list[Annotated[ChatMessage, Item]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class TokenizeChatRequest(ChatTemplateRequest):
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(APIRequest):
    tokens: TokenIds


# ---- responses ----------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def _now() -> int:
    return int(time.time())


ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class ChoicesResponse(BaseModel, Generic[ChoiceT]):
    """What a completion, a chat completion and a chat chunk share; each names its `object`."""
    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChoiceT]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class LogprobEntry(BaseModel):
    """vLLM's Logprob: one token's log-probability, rank (1: the likeliest) and text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    # With prompt_logprobs (vLLM's): per prompt position, token id -> entry; the first is None.
    prompt_logprobs: list[dict[int, LogprobEntry] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # extension: the stop string or token that ended it
    token_ids: list[int] | None = None  # with return_token_ids (delta when streamed)


class CompletionResponse(ChoicesResponse[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoiceBase(BaseModel):
    """What a chat choice says beside its message, whole or streamed."""
    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids (delta when streamed)


class ChatChoice(ChatChoiceBase):
    message: ChatMessageOut


class ChatCompletionResponse(ChoicesResponse[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(ChatChoiceBase):
    delta: DeltaMessage


class ChatCompletionChunk(ChoicesResponse[ChatStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "jaxserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EmbeddingFields(APIRequest):
    """What both kinds of `POST /v1/embeddings` body have (OpenAI's, then vLLM's)."""
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {"dimensions": (None,)}
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    priority: int = 0
    request_id: str | None = None


class EmbeddingRequest(EmbeddingFields):
    """`POST /v1/embeddings` of one or more inputs (text or token ids)."""
    input: Annotated[Prompts, _prompts("input")]
    add_special_tokens: bool = True


class EmbeddingChatRequest(ChatTemplateRequest, EmbeddingFields):
    """`POST /v1/embeddings` of one conversation through the chat template (vLLM's); no
    generation prompt unless asked."""
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = (ChatTemplateRequest.UNSUPPORTED
                                                         | EmbeddingFields.UNSUPPORTED)
    add_generation_prompt: bool = False


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
