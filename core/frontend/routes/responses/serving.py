"""OpenAI's Responses API over chat's serving: a request is served as the chat
completion it describes (protocol.py), and its one choice's text and tool calls
become the response's output items: a `message` with one `output_text` part, and a
`function_call` item per call.

Streamed, the events are OpenAI's, each an SSE `event:` + `data:` pair with a
sequence_number: response.created, response.in_progress; per item
response.output_item.added, (a message) response.content_part.added,
response.output_text.delta…, response.output_text.done, response.content_part.done or
(a call) response.function_call_arguments.delta…, response.function_call_arguments.done;
response.output_item.done; and last response.completed (response.incomplete when
max_output_tokens cut it short, response.failed if the engine failed). No [DONE].

With `include: ["message.output_text.logprobs"]`, the output_text part carries the logprobs
of the choice's tokens in chat's shape (as vLLM, all of them), and each text delta those
of the tokens that brought it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from pydantic import ValidationError

from plugserve.datatypes import Logprobs, RequestDelta
from plugserve.frontend.errors import InvalidRequest, internal_error_message
from plugserve.frontend.request_state import EngineDeadError, RequestError
from plugserve.frontend.routes.chat.protocol import ChatCompletionRequest
from plugserve.frontend.routes.chat.serving import ChatServing, PreparedChat
from plugserve.frontend.routes.responses.protocol import ResponsesRequest
from plugserve.frontend.serving import OpenAIServing

logger = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def prepare(self, body: ResponsesRequest, request_id: str) -> PreparedChat:
        """Validate `body` as the chat request it describes; InvalidRequest if it is not one."""
        body.check()
        try:
            chat = ChatCompletionRequest.model_validate(body.chat_body())
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise InvalidRequest(f"input: {where}: {err['msg']}", "input") from exc
        return ChatServing(self.serving).prepare(chat, f"resp_{request_id}")

    # ------------------------------------------------------------------ shapes

    def _logprobs(self, body: ResponsesRequest, delta: RequestDelta) -> list[dict[str, Any]]:
        """The delta's tokens' logprobs in chat's shape, which is OpenAI's here too; none
        unless `include` asks for them."""
        if not body.output_logprobs or not delta.logprobs:
            return []
        entries: list[tuple[int, Logprobs]] = list(
            zip(delta.token_ids, delta.logprobs, strict=False)
        )
        return self.serving.logprobs.chat(entries, tokens_as_ids=False)["content"]

    def _response(
        self, body: ResponsesRequest, prep: PreparedChat, status: str, output: list[Any]
    ) -> dict[str, Any]:
        return {
            "id": prep.request_id,
            "object": "response",
            "created_at": prep.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.serving.model_name,
            "output": output,
            "usage": None,
            **body.echoed(),
            "temperature": prep.params.temperature,
            "top_p": prep.params.top_p,
        }

    @staticmethod
    def _finished(response: dict[str, Any], finish_reason: str | None, usage: dict) -> None:
        if finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
        response["usage"] = usage

    @staticmethod
    def _usage(
        prep: PreparedChat, output_tokens: int, cached: int, reasoning_tokens: int
    ) -> dict[str, Any]:
        input_tokens = len(prep.prompts[0])
        return {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens,
        }

    # ------------------------------------------------------------------ non-streamed

    async def create(self, body: ResponsesRequest, prep: PreparedChat) -> dict[str, Any]:
        text: list[str] = []
        token_ids: list[int] = []
        logprobs: list[dict[str, Any]] = []
        finish_reason, output_tokens, cached, reasoning_tokens = None, 0, 0, 0
        async for _, delta in self.serving.run(prep):
            text.append(delta.text)
            token_ids += delta.token_ids
            reasoning_tokens = delta.num_reasoning_tokens
            logprobs += self._logprobs(body, delta)
            finish_reason = delta.finish_reason
            output_tokens = delta.num_output_tokens
            cached = max(cached, delta.num_cached_tokens)
        choice = prep.make_output()
        content, calls = choice.final("".join(text), token_ids)
        output: list[dict[str, Any]] = []
        if choice.reasoning is not None:
            output.append(_reasoning(_item_id("rs"), choice.reasoning, "completed"))
        if content or not calls:
            output.append(_message(_item_id("msg"), content or "", "completed", logprobs))
        output += [
            _function_call(_item_id("fc"), c["id"], c["function"]["name"], "completed")
            | {"arguments": c["function"]["arguments"]}
            for c in calls
        ]
        response = self._response(body, prep, "completed", output)
        usage = self._usage(prep, output_tokens, cached, reasoning_tokens)
        self._finished(response, finish_reason, usage)
        return response

    # ------------------------------------------------------------------ streamed

    async def stream(self, body: ResponsesRequest, prep: PreparedChat) -> AsyncIterator[bytes]:
        events = _Events()
        response = self._response(body, prep, "in_progress", [])
        yield events.send("response.created", response=response)
        yield events.send("response.in_progress", response=response)
        items = _StreamedItems(events)
        choice = prep.make_output()
        finish_reason, output_tokens, cached, reasoning_tokens = None, 0, 0, 0
        try:
            async for _, delta in self.serving.run(prep):
                output_tokens = delta.num_output_tokens
                reasoning_tokens = delta.num_reasoning_tokens
                cached = max(cached, delta.num_cached_tokens)
                items.pending_logprobs += self._logprobs(body, delta)
                chat_deltas = choice.feed(delta.text, delta.token_ids)
                if delta.finished:
                    finish_reason = delta.finish_reason
                    chat_deltas += choice.finish()
                for chat_delta in chat_deltas:
                    for event in items.feed(chat_delta):
                        yield event
        except Exception as exc:
            if isinstance(exc, (EngineDeadError, RequestError)):
                message = str(exc)
            else:
                logger.exception("a streamed response failed")
                message = internal_error_message(exc)
            for event in items.close():
                yield event
            response = {**response, "output": items.output, "status": "failed"}
            response["error"] = {"code": "server_error", "message": message}
            yield events.send("response.failed", response=response)
            return
        for event in items.close():
            yield event
        if not items.output:  # nothing was generated: an empty message, as non-streamed
            for event in items.feed({"content": ""}, force=True):
                yield event
            for event in items.close():
                yield event
        response = {**response, "output": items.output}
        usage = self._usage(prep, output_tokens, cached, reasoning_tokens)
        self._finished(response, finish_reason, usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield events.send(kind, response=response)


def _message(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [_part(text, logprobs)] if status == "completed" else [],
    }


def _reasoning(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning output item: the thinking as one `reasoning_text` part (no summary,
    nothing encrypted)."""
    return {
        "id": item_id,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else [],
        "encrypted_content": None,
    }


def _function_call(item_id: str, call_id: str, name: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": "",
    }


class _Events:
    def __init__(self) -> None:
        self.sequence_number = 0

    def send(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"


class _StreamedItems:
    """The output items as the chat deltas of the choice open, fill and close them."""

    def __init__(self, events: _Events) -> None:
        self.events = events
        self.output: list[dict[str, Any]] = []  # the items closed so far
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text: list[str] = []  # of the open item: its text or arguments
        # Of tokens whose text no event has carried yet; then those of the open message.
        self.pending_logprobs: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []

    def feed(self, delta: dict[str, Any], force: bool = False) -> list[bytes]:
        out: list[bytes] = []
        reasoning = delta.get("reasoning_content")
        if reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                out += self.close()
                out += self._open(_reasoning(_item_id("rs"), "", "in_progress"))
            self.text.append(reasoning)
            out.append(self._send("response.reasoning_text.delta", delta=reasoning))
        content = delta.get("content")
        if content or (force and content is not None):
            if self.open is None or self.open["type"] != "message":
                out += self.close()
                out += self._open(_message(_item_id("msg"), "", "in_progress"))
                out.append(self._send("response.content_part.added", part=_part("")))
            if content:
                self.text.append(content)
                logprobs, self.pending_logprobs = self.pending_logprobs, []
                self.logprobs += logprobs
                out.append(
                    self._send("response.output_text.delta", delta=content, logprobs=logprobs)
                )
        for call in delta.get("tool_calls") or []:
            function = call.get("function", {})
            if "id" in call:
                out += self.close()
                out += self._open(
                    _function_call(_item_id("fc"), call["id"], function["name"], "in_progress")
                )
            if function.get("arguments"):
                self.text.append(function["arguments"])
                out.append(
                    self._send(
                        "response.function_call_arguments.delta", delta=function["arguments"]
                    )
                )
        return out

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        self.open, self.text, self.logprobs = item, [], []
        return [
            self.events.send("response.output_item.added", output_index=len(self.output), item=item)
        ]

    def _send(self, kind: str, **fields: Any) -> bytes:
        assert self.open is not None
        where: dict[str, Any] = {"item_id": self.open["id"], "output_index": len(self.output)}
        if self.open["type"] in ("message", "reasoning"):
            where["content_index"] = 0
        return self.events.send(kind, **where, **fields)

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        item, text = self.open, "".join(self.text)
        if item["type"] == "message":
            # Tokens that brought no text of their own (the end of the sequence) are still
            # the message's.
            logprobs, self.pending_logprobs = self.logprobs + self.pending_logprobs, []
            out = [
                self._send("response.output_text.done", text=text, logprobs=logprobs),
                self._send("response.content_part.done", part=_part(text, logprobs)),
            ]
            done = _message(item["id"], text, "completed", logprobs)
        elif item["type"] == "reasoning":
            out = [self._send("response.reasoning_text.done", text=text)]
            done = _reasoning(item["id"], text, "completed")
        else:
            self.pending_logprobs = []  # the call's tokens: a call item has no logprobs
            out = [
                self._send(
                    "response.function_call_arguments.done", arguments=text, name=item["name"]
                )
            ]
            done = {**item, "arguments": text, "status": "completed"}
        out.append(
            self.events.send("response.output_item.done", output_index=len(self.output), item=done)
        )
        self.output.append(done)
        self.open, self.text, self.logprobs = None, [], []
        return out


def _part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
