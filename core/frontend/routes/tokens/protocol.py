"""The bodies of vLLM's /tokenize and /detokenize."""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from plugserve.frontend.protocol import ChatMessage, StrictModel, Tool


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default: true for a prompt, false for messages (the template writes its own).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None:
            chat_only = {
                "add_generation_prompt",
                "continue_final_message",
                "tools",
                "chat_template",
                "chat_template_kwargs",
            } & self.model_fields_set
            if chat_only:
                raise ValueError(f"{', '.join(sorted(chat_only))}: only with messages")
        elif self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt to false to continue the last message)"
            )
        return self

    def conversation(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True, exclude={"refusal"}) for m in self.messages or []]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
