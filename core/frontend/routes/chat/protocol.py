"""The body of POST /v1/chat/completions: OpenAI's fields and vLLM's chat extras
(template options), on the sampling fields every completion shares."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from plugserve.frontend.protocol import ChatMessage, NamedToolChoice, SamplingRequest, Tool


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: at most this many reasoning tokens; then the engine ends the thinking.
    thinking_token_budget: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt to false to continue the last message)"
            )
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, "none" otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the renderer takes them (OpenAI's JSON shape)."""
        return [m.model_dump(exclude_none=True, exclude={"refusal"}) for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]
