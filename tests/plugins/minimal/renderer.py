"""A third-party renderer, the smallest real one: no chat template, each message a
"role: content" line and then "assistant:" for the model to go on from.

Loaded through PLUGSERVE_PLUGIN_MODULES=tests.plugins.minimal.renderer, the way an
unpackaged plugin module is; tests/plugins/test_minimal_plugins.py selects it.
"""

from __future__ import annotations

from typing import Any

from plugserve import hookimpl
from plugserve.hookspecs import Register


class PlainTranscriptRenderer:
    """interfaces.frontend.Renderer: a conversation as a plain transcript, tokenized."""

    def __init__(self, *, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_id = self.tokenizer.eos_token_id

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        if tools or chat_template:
            raise ValueError("the plain transcript has no template for tools or a chat_template")
        lines = []
        for message in messages:
            if not isinstance(message.get("content"), str):
                raise ValueError("the plain transcript takes text content only")
            lines.append(f"{message['role']}: {message['content']}")
        if add_generation_prompt and not continue_final_message:
            lines.append("assistant:")
        return self.encode("\n".join(lines))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


@hookimpl
def register_renderers(register: Register) -> None:
    register("plain_transcript", PlainTranscriptRenderer)
