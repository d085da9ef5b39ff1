"""The bodies of Anthropic's Messages API (`POST /v1/messages`,
`POST /v1/messages/count_tokens`), pydantic, unknown fields rejected by name as on every
other route; and the chat completion request a Messages request is served as (`system`
→ a system message, `tool_use` → an assistant's tool calls, `tool_result` → tool
messages, `tool_choice` → chat's, `thinking` → the chat template's `enable_thinking`
and the thinking budget)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from plugserve.frontend.protocol import StrictModel

# Accepted on every block and tool and ignored: prompt caching is automatic here.
CacheControl = dict[str, Any] | None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = None  # on an assistant's text echoed back; not rendered


class ToolUseBlock(StrictModel):
    """A call the assistant made in an earlier turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(StrictModel):
    """The result of a call, for the model's next turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlock(StrictModel):
    """An assistant's thinking echoed back: accepted and not rendered (a reasoning
    model's template drops earlier turns' thinking)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


def _block_kind(block: Any) -> str:
    return block.get("type", "") if isinstance(block, dict) else getattr(block, "type", "")


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_kind),
]


class MessageParam(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDefinition(StrictModel):
    """A client tool: its name, description and the JSON schema of its input."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingEnabled(StrictModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)
    # "summarized" (thinking returned as written) only: nothing here redacts thinking.
    display: Literal["summarized"] | None = None


class ThinkingAdaptive(StrictModel):
    """The model thinks as much as it likes: thinking on, no budget."""

    type: Literal["adaptive"]
    display: Literal["summarized"] | None = None


class ThinkingDisabled(StrictModel):
    type: Literal["disabled"]


Thinking = Annotated[
    Annotated[ThinkingEnabled, Tag("enabled")]
    | Annotated[ThinkingAdaptive, Tag("adaptive")]
    | Annotated[ThinkingDisabled, Tag("disabled")],
    Discriminator(_block_kind),
]


class Metadata(StrictModel):
    user_id: str | None = None


class ConversationRequest(StrictModel):
    """What a Messages request and a count_tokens request share: the prompt."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request fields of the prompt."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages()}
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "parameters": tool.input_schema,
                        **({"description": tool.description} if tool.description else {}),
                    },
                }
                for tool in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                    choice.type
                ]
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if isinstance(self.thinking, ThinkingEnabled | ThinkingAdaptive):
            body["chat_template_kwargs"] = {"enable_thinking": True}
        if isinstance(self.thinking, ThinkingEnabled):
            body["thinking_token_budget"] = self.thinking.budget_tokens
        elif isinstance(self.thinking, ThinkingDisabled):
            body["chat_template_kwargs"] = {"enable_thinking": False}
        return body

    def chat_messages(self) -> list[dict[str, Any]]:
        """`system` first, then each message as chat messages: a user turn's tool results
        become tool messages before its text; an assistant turn's tool uses its calls."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            if not isinstance(system, str):
                system = "\n".join(block.text for block in system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            content = message.content
            if isinstance(content, str):
                messages.append({"role": message.role, "content": content})
                continue
            texts = [b.text for b in content if isinstance(b, TextBlock)]
            if message.role == "user":
                for block in content:
                    if isinstance(block, ToolResultBlock):
                        messages.append(
                            {
                                "role": "tool",
                                "tool_call_id": block.tool_use_id,
                                "content": block.text(),
                            }
                        )
                if texts:
                    messages.append({"role": "user", "content": "\n".join(texts)})
                continue
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in content
                if isinstance(b, ToolUseBlock)
            ]
            turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
            if calls:
                turn["tool_calls"] = calls
            elif turn["content"] is None:
                turn["content"] = ""
            messages.append(turn)
        return messages


class MessagesRequest(ConversationRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    # Accepted and ignored: nothing is stored, and there is one tier.
    metadata: Metadata | None = None
    service_tier: str | None = None

    def ignored_fields(self) -> list[str]:
        """The fields given that change nothing here, by name (logged at debug level)."""
        ignored = [name for name in ("metadata", "service_tier") if name in self.model_fields_set]
        system = [] if self.system is None or isinstance(self.system, str) else self.system
        if any(block.cache_control for block in system):
            ignored.append("system.cache_control")
        for tool in self.tools or []:
            if tool.cache_control:
                ignored.append("tools.cache_control")
                break
        for message in self.messages:
            blocks = [] if isinstance(message.content, str) else message.content
            if any(getattr(b, "cache_control", None) for b in blocks):
                ignored.append("messages.content.cache_control")
                break
        return ignored

    def chat_body(self) -> dict[str, Any]:
        body = super().chat_body()
        body["max_tokens"] = self.max_tokens
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return body


class CountTokensRequest(ConversationRequest):
    """`/v1/messages/count_tokens`: the prompt a Messages request with these fields
    would send to the engine."""
