"""OpenAI's Responses API request (`POST /v1/responses`), pydantic, unknown fields
rejected by name like every other body; and how it becomes the chat request it is
served as (instructions → a system message, input items → messages, function tools →
chat tools, `text.format` → response_format, `include`'s output logprobs → chat's
logprobs)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.protocol import (
    IGNORED_FIELDS,
    FunctionDefinition,
    JsonSchemaFormat,
    StrictModel,
)

# ------------------------------------------------------------------ input items


class InputText(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # on output_text echoed back; not rendered
    logprobs: list[Any] | None = None


class InputMessage(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None  # on a previous response's message echoed back
    status: str | None = None


class FunctionCallItem(StrictModel):
    """A call the model made in a previous turn, echoed back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(StrictModel):
    """The result of a call, for the model's next turn."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def _item_kind(item: Any) -> str:
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind or "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")],
    Discriminator(_item_kind),
]


# ------------------------------------------------------------------ tools, text


class FunctionTool(FunctionDefinition):
    """A Responses function tool: the chat tool's `function`, flattened."""

    type: Literal["function"]


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """`text.format`: text, any JSON object, or a JSON schema (flattened: name, schema…)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: None = None


# ------------------------------------------------------------------ the request

# The `include` values this server implements; any other is refused by name, since
# each asks for output a client would otherwise wait for in vain.
OUTPUT_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (OUTPUT_LOGPROBS,)


class ResponsesStreamOptions(StrictModel):
    """The Responses API's stream options: only obfuscation (usage is always in the last
    event), so chat's include_usage is rejected here by name."""

    # OpenAI pads streamed events against side channels; plugserve sends no padding.
    include_obfuscation: bool | None = None


class ResponsesRequest(StrictModel):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    # Clients send an empty list when they want nothing extra (the openai-agents SDK
    # always does); checked by `check`.
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's extension, as on chat completions: extra variables for the chat template.
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and ignored (IGNORED_FIELDS): nothing is stored.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def ignored_fields(self) -> list[str]:
        return [name for name in IGNORED_FIELDS if name in self.model_fields_set]

    @property
    def output_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())

    def check(self) -> None:
        """InvalidRequest for what this server cannot give: an `include` value it does
        not implement, or alternatives (`top_logprobs`) without the logprobs they are
        part of."""
        for value in self.include or ():
            if value not in INCLUDABLE:
                raise InvalidRequest(
                    f"include: {value!r} is not supported by this server "
                    f"(supported: {', '.join(INCLUDABLE)})",
                    "include",
                )
        if self.top_logprobs and not self.output_logprobs:
            raise InvalidRequest(
                f"top_logprobs needs include: [{OUTPUT_LOGPROBS!r}], which returns them",
                "top_logprobs",
            )

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request this one is served as (validated by the caller)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages()}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.output_logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = JsonSchemaFormat(
                name=fmt.name or "response",
                description=fmt.description,
                schema=fmt.schema_,
                strict=fmt.strict,
            )
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": schema.model_dump(by_alias=True, exclude_none=True),
            }
        return body

    def messages(self) -> list[dict[str, Any]]:
        """instructions first (a system message), then the input as chat messages:
        consecutive function calls become one assistant turn with tool_calls, their
        outputs tool messages."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        for item in self.input:
            if isinstance(item, InputMessage):
                content = item.content
                if not isinstance(content, str):
                    content = [{"type": "text", "text": part.text} for part in content]
                messages.append({"role": item.role, "content": content})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
        return messages

    def echoed(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        fmt = self.text.format if self.text is not None and self.text.format else None
        tool_choice: Any = self.tool_choice or ("auto" if self.tools else "none")
        if isinstance(tool_choice, NamedFunctionChoice):
            tool_choice = tool_choice.model_dump()
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": self.temperature,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt
                else {"type": "text"}
            },
            "tool_choice": tool_choice,
            "tools": [t.model_dump() for t in self.tools or []],
            "top_logprobs": self.top_logprobs,
            "top_p": self.top_p,
            "truncation": "disabled",
            "user": self.user,
        }
