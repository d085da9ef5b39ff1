"""The `hf` renderer: a Hugging Face tokenizer and its chat template (phase 1).

Turns an OpenAI-style conversation into prompt token ids in the API-server process. The
conversation is validated here, before it reaches Jinja, so that a bad request fails with
a message naming the offending message rather than a template traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jinja2

from plugserve import hookimpl

# apply_chat_template arguments that change what it returns or how it tokenizes: the
# renderer owns them, so a request must not smuggle them in through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "tokenizer_kwargs",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
    }
)


class HFRenderer:
    """Chat template and tokenization through `transformers.AutoTokenizer`.

    Built once per API-server process from an HF folder holding the tokenizer files (the
    chat template in tokenizer_config.json or chat_template.jinja).
    """

    def __init__(self, *, model_path: str) -> None:
        # Imported here: transformers pulls in torch (~1.5 s), and every process that
        # discovers plugins imports this module, most of them never building a renderer.
        from transformers import AutoTokenizer

        self.model_path = model_path
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_id: int | None = self.tokenizer.eos_token_id

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
        """Apply the chat template and tokenize; raise ValueError for a malformed
        conversation, a template that rejects it, or a model without a chat template.

        Content given as a list of text parts is joined with newlines, since templates
        written for plain-text models concatenate `message['content']` as a string; an
        assistant turn with only tool calls gets empty content, and its calls' arguments
        are given to the template as objects (templates write them with `tojson`).
        `tools` reach the template as transformers' `apply_chat_template(tools=...)`
        passes them; `continue_final_message` leaves the last (assistant) message open
        for the model to continue; `chat_template` replaces the model's own template.
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message continues the last message; it cannot be combined "
                "with add_generation_prompt (set add_generation_prompt to false)"
            )
        conversation = _normalize_conversation(messages)
        if continue_final_message and conversation[-1]["role"] != "assistant":
            raise ValueError(
                "continue_final_message needs the last message to be the assistant's, "
                f"got {conversation[-1]['role']!r}"
            )
        extra = _check_template_kwargs(chat_template_kwargs)
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"the model at {self.model_path} has no chat template; "
                "send a plain prompt (completions) instead of chat messages"
            )
        try:
            prompt = self.tokenizer.apply_chat_template(
                conversation,
                tools=tools or None,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **extra,
            )
        except jinja2.TemplateError as exc:
            # Templates signal invalid conversations (e.g. roles not alternating) through
            # raise_exception, which surfaces as a TemplateError: a client error, not ours.
            raise ValueError(f"the chat template rejected the conversation: {exc}") from exc
        except (TypeError, ValueError) as exc:  # a template that failed on this input
            raise ValueError(f"the chat template failed on this conversation: {exc}") from exc
        # The template writes every control token itself, BOS included; letting the
        # tokenizer add its own special tokens again would double the BOS.
        return self.encode(prompt, add_special_tokens=False)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"the prompt must be a string, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _normalize_conversation(messages: Any) -> list[dict[str, Any]]:
    """Validate an OpenAI-style conversation and return a copy whose contents are strings."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must contain at least one message")
    return [_normalize_message(i, message) for i, message in enumerate(messages)]


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}.role must be a non-empty string, got {role!r}")
    # Copy so that normalizing never mutates the caller's request body.
    normalized = dict(message)
    tool_calls = message.get("tool_calls")
    if tool_calls:
        if role != "assistant":
            raise ValueError(f"{where} ({role}) has tool_calls; only assistant turns may")
        normalized["tool_calls"] = [_template_tool_call(where, c) for c in tool_calls]
    if message.get("content") is None:
        if not tool_calls:
            if "content" not in message:
                raise ValueError(f"{where} ({role}) has no content")
            raise ValueError(
                f"{where}.content is null; only an assistant turn with tool_calls may omit it"
            )
        normalized["content"] = ""
    else:
        normalized["content"] = _content_text(where, message["content"])
    return normalized


def _template_tool_call(where: str, call: Any) -> dict[str, Any]:
    """An OpenAI tool call with its arguments (JSON text) as an object, which is what
    chat templates expect (they write `tool_call.arguments | tojson`); vLLM passes them
    the same way."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ValueError(f"{where}.tool_calls: each call must be an object with a function")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{where}.tool_calls: the arguments of {function.get('name')!r} are not JSON: {exc}"
            ) from exc
    return {**call, "function": function}


def _content_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"{where}.content must be a string or a list of text parts, "
            f"got {type(content).__name__}"
        )
    texts: list[str] = []
    for j, part in enumerate(content):
        part_where = f"{where}.content[{j}]"
        if not isinstance(part, Mapping):
            raise ValueError(f"{part_where} must be an object, got {type(part).__name__}")
        if part.get("type") != "text":
            raise ValueError(
                f"{part_where} has type {part.get('type')!r}; only 'text' parts are supported"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{part_where}.text must be a string, got {type(text).__name__}")
        texts.append(text)
    return "\n".join(texts)


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}")
    bad_keys = [key for key in kwargs if not isinstance(key, str)]
    if bad_keys:
        raise ValueError(f"chat_template_kwargs keys must be strings, got {bad_keys!r}")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    return dict(kwargs)


@hookimpl
def register_renderers(register):
    register("hf", HFRenderer)
