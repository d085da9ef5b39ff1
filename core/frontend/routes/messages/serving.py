"""Anthropic's Messages API over chat's serving: a request is served as the chat
completion it describes (protocol.py), and its one choice's reasoning, text and tool
calls become the message's content blocks: `thinking`, `text`, `tool_use`.

Streamed, the events are Anthropic's, each an SSE `event:` + `data:` pair:
message_start; per block content_block_start, content_block_delta (`thinking_delta`
then a `signature_delta`, `text_delta`, or `input_json_delta`), content_block_stop;
message_delta with the stop reason and the output tokens; message_stop. An error once
the stream has started is an `error` event.

A thinking block's `signature` is the hex SHA-256 of its thinking text: plugserve signs
nothing (Anthropic's signature is an opaque token its own servers verify), and a client
that sends the block back unchanged needs only a string there; this server does not check
it, and thinking in the history is not rendered.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from pydantic import ValidationError

from plugserve.frontend.errors import InvalidRequest, internal_error_message
from plugserve.frontend.request_state import EngineDeadError, RequestError
from plugserve.frontend.routes.chat.protocol import ChatCompletionRequest
from plugserve.frontend.routes.chat.serving import ChatServing, PreparedChat
from plugserve.frontend.routes.messages.errors import error_type
from plugserve.frontend.routes.messages.protocol import (
    ConversationRequest,
    CountTokensRequest,
    MessagesRequest,
    ThinkingAdaptive,
    ThinkingEnabled,
)
from plugserve.frontend.serving import OpenAIServing, render_chat_request

logger = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


def signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode()).hexdigest()


def _tool_use_id(call_id: str) -> str:
    """Anthropic's id shape (toolu_…) for the call's id."""
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object `input` is; {} where the output was cut short."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish_reason: str | None, stop: int | str | None, called: bool) -> str | None:
    if finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    if isinstance(stop, str):
        return "stop_sequence"
    return "end_turn" if finish_reason is not None else None


class MessagesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _chat(self, body: ConversationRequest) -> ChatCompletionRequest:
        self.serving.check_model(body.model)
        thinks = isinstance(body.thinking, ThinkingEnabled | ThinkingAdaptive)
        if thinks and self.serving.reasoning_parser is None:
            raise InvalidRequest(
                "thinking: this server has no reasoning parser (stack.reasoning_parser) "
                "to separate a model's thinking",
                "thinking",
            )
        chat_body = body.chat_body()
        if isinstance(body, CountTokensRequest):
            chat_body["max_tokens"] = 1
        try:
            return ChatCompletionRequest.model_validate(chat_body)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise InvalidRequest(f"{where}: {err['msg']}", where) from exc

    def prepare(self, body: MessagesRequest, request_id: str) -> PreparedChat:
        """Validate `body` as the chat request it describes; InvalidRequest if it is not one."""
        if logger.isEnabledFor(logging.DEBUG) and (ignored := body.ignored_fields()):
            logger.debug("request fields accepted and ignored: %s", ", ".join(ignored))
        return ChatServing(self.serving).prepare(self._chat(body), f"msg_{request_id}")

    def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """The prompt tokens a Messages request of `body`'s prompt sends the engine."""
        chat = self._chat(body)
        ChatServing(self.serving).prepare(chat)  # the same checks: tools, tool_choice
        return {"input_tokens": len(render_chat_request(self.serving.renderer, chat))}

    def _message(self, prep: PreparedChat, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": prep.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.serving.model_name,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(prep.prompts[0]), "output_tokens": 0},
        }

    # ------------------------------------------------------------------ non-streamed

    async def create(self, prep: PreparedChat) -> dict[str, Any]:
        [choice], cached = await self.serving.collect(prep)
        output = prep.make_output()
        text, calls = output.final("".join(choice.text), choice.token_ids)
        content: list[dict[str, Any]] = []
        if output.reasoning is not None:
            thinking = output.reasoning
            content.append(
                {"type": "thinking", "thinking": thinking, "signature": signature(thinking)}
            )
        if text:
            content.append({"type": "text", "text": text})
        for call in calls:
            function = call["function"]
            content.append(
                {
                    "type": "tool_use",
                    "id": _tool_use_id(call["id"]),
                    "name": function["name"],
                    "input": _input(function["arguments"]),
                }
            )
        message = self._message(prep, content)
        message["stop_reason"] = stop_reason(choice.finish_reason, choice.stop_reason, bool(calls))
        if message["stop_reason"] == "stop_sequence":
            message["stop_sequence"] = choice.stop_reason
        message["usage"].update(
            output_tokens=choice.num_output_tokens,
            cache_read_input_tokens=cached,
            cache_creation_input_tokens=0,
        )
        return message

    # ------------------------------------------------------------------ streamed

    async def stream(self, prep: PreparedChat) -> AsyncIterator[bytes]:
        message = self._message(prep, [])
        yield _event("message_start", message=message)
        blocks = _StreamedBlocks()
        output = prep.make_output()
        finish, stop, num_output = None, None, 0
        try:
            async for _, delta in self.serving.run(prep):
                num_output = delta.num_output_tokens
                chat_deltas = output.feed(delta.text, delta.token_ids)
                if delta.finished:
                    finish, stop = delta.finish_reason, delta.stop_reason
                    chat_deltas += output.finish()
                for chat_delta in chat_deltas:
                    for event in blocks.feed(chat_delta):
                        yield event
        except Exception as exc:
            if isinstance(exc, EngineDeadError):
                status, text = 503, str(exc)
            elif isinstance(exc, RequestError):
                status, text = exc.status, str(exc)
            else:
                logger.exception("a streamed message failed")
                status, text = 500, internal_error_message(exc)
            yield _event("error", error={"type": error_type(status), "message": text})
            return
        for event in blocks.close():
            yield event
        reason = stop_reason(finish, stop, output.num_calls > 0)
        sequence = stop if reason == "stop_sequence" else None
        yield _event(
            "message_delta",
            delta={"stop_reason": reason, "stop_sequence": sequence},
            usage={"output_tokens": num_output},
        )
        yield _event("message_stop")


def _event(kind: str, **fields: Any) -> bytes:
    payload = {"type": kind, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"


class _StreamedBlocks:
    """The content blocks as the chat deltas of the choice open, fill and close them."""

    def __init__(self) -> None:
        self.index = -1  # of the open block
        self.open: str | None = None  # its type
        self.thinking: list[str] = []

    def feed(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        reasoning = delta.get("reasoning_content")
        if reasoning:
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.thinking.append(reasoning)
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        content = delta.get("content")
        if content:
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": content}))
        for call in delta.get("tool_calls") or []:
            function = call.get("function", {})
            if "id" in call:
                block = {
                    "type": "tool_use",
                    "id": _tool_use_id(call["id"]),
                    "name": function["name"],
                    "input": {},
                }
                out += self._start(block)
            if function.get("arguments"):
                out.append(
                    self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
                )
        return out

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        out.append(_event("content_block_start", index=self.index, content_block=block))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.index, delta=delta)

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            sig = signature("".join(self.thinking))
            out.append(self._delta({"type": "signature_delta", "signature": sig}))
            self.thinking = []
        out.append(_event("content_block_stop", index=self.index))
        self.open = None
        return out
