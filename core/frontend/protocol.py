"""OpenAI request bodies (pydantic, validated) and how they become SamplingParams.

Every model forbids fields it does not declare: a field the server does not implement
is a 400 naming it, never silently dropped. The few fields OpenAI's SDKs send with no
effect on the output (IGNORED_FIELDS) are declared, accepted and logged at debug level.
docs/api.md lists every field with its status.

What every request body shares lives here: the strict base model, messages, output
constraints, tools and the sampling fields of chat and text completions. Each endpoint's
own body is in its folder (routes/<family>/protocol.py). Responses are built as plain
dicts: their shape is OpenAI's and nothing on our side reads them back.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from plugserve.sampling_params import SamplingParams

# Accepted and without effect on the output: metadata OpenAI's SDKs and clients send
# routinely (stored completions, billing and abuse identifiers, caching hints).
IGNORED_FIELDS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
)


# What an integer the engine takes may be (msgspec carries up to 2**64 - 1, numpy's and
# torch's int64 hold less): vLLM's bounds on a seed.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    # OpenAI pads streamed chunks against side channels; plugserve sends no padding.
    include_obfuscation: bool | None = None


# ------------------------------------------------------------------ messages


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


def _only_text_parts(content: Any) -> Any:
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content[{j}] has type {kind!r}; only 'text' parts are supported")
    return content


Content = Annotated[str | list[TextPart], BeforeValidator(_only_text_parts)]


class SystemMessage(StrictModel):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(StrictModel):
    role: Literal["user"]
    content: Content
    name: str | None = None


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(StrictModel):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallParam] | None = None
    name: str | None = None
    refusal: str | None = None  # echoed back by clients; not rendered

    @model_validator(mode="after")
    def _content_or_calls(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(StrictModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


# ------------------------------------------------------------------ constraints


class JsonSchemaFormat(StrictModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # Always enforced: plugserve constrains the output to the schema, strict or not.
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


class StructuredOutputsRequest(StrictModel):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# ------------------------------------------------------------------ tools


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Always enforced when the call is forced (tool_choice required or named).
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


# ------------------------------------------------------------------ requests


class SamplingRequest(StrictModel):
    """The fields chat and text completions share; each says how it asks for a length
    and for logprobs (`requested_max_tokens`, `num_logprobs`)."""

    model: str
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # With n > 1, choice i samples with seed + i (at most 127 more, still in a uint64).
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    # vLLM's: logprobs name tokens "token_id:<id>" instead of their text, so a client
    # sees exactly which token was chosen (a text can stand for several token ids).
    return_tokens_as_token_ids: bool = False
    # OpenAI's: token id (as a string key) -> bias in [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = None
    # vLLM's: only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never to complete (tokenized with and without a leading space).
    bad_words: list[str] | None = None
    # Output constraints: at most one of these (and of tool_choice required / named).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted and ignored (IGNORED_FIELDS).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _check(self) -> SamplingRequest:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 16:
            raise ValueError("stop accepts at most 16 strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def ignored_fields(self) -> list[str]:
        """The accepted-and-ignored fields this request set (logged at debug level)."""
        names = [name for name in IGNORED_FIELDS if name in self.model_fields_set]
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            names.append("stream_options.include_obfuscation")
        return names

    def sampling_params(
        self,
        *,
        max_tokens: int | None,
        num_logprobs: int | None,
        defaults: dict[str, float | int] | None = None,
        **extra: Any,
    ) -> SamplingParams:
        """`defaults`: the model's own values (generation_config.json) of the sampling
        fields the request leaves out; OpenAI's defaults otherwise. `extra`: the fields the
        serving layer derives with the tokenizer and the structured-output backend
        (logit_bias, bad_words_token_ids, structured_outputs…)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        model = defaults or {}

        def pick(name: str, fallback: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else model.get(name, fallback)

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=num_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=self.allowed_token_ids,
            **extra,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    @property
    def num_logprobs(self) -> int | None:
        raise NotImplementedError
