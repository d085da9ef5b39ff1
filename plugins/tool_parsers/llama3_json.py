"""The `llama3_json` tool parser: Llama 3.1 / 3.2 / 3.3 answer a tool call with a JSON
object and nothing else,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after the `<|python_tag|>` token (kept in the text only when special tokens
are not skipped), several calls separated by `;`. An output that does not start with
an object, or whose objects do not parse as calls, is plain content.
"""

from __future__ import annotations

import json
from typing import Any

from plugserve import hookimpl
from plugserve.interfaces.frontend import ExtractedToolCalls, ToolCall

from ._common import call_from_object, partial_marker_len

PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("parameters", "arguments")
_decoder = json.JSONDecoder()


def _strip_tag(text: str) -> str:
    text = text.lstrip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG) :].lstrip()
    return text


def _decode_calls(text: str) -> tuple[list[ToolCall], str]:
    """The calls at the start of `text` (objects separated by `;` or whitespace) and what
    follows the last one that parsed: an incomplete object, or text that is no call."""
    calls: list[ToolCall] = []
    position = 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
        if position == len(text) or text[position] != "{":
            return calls, text[position:]
        try:
            obj, end = _decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return calls, text[position:]
        call = call_from_object(obj, _ARGUMENT_KEYS)
        if call is None:
            return calls, text[position:]
        calls.append(call)
        position = end


class Llama3JsonToolParser:
    def __init__(self, *, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        self.tools = tools
        self._raw = ""  # everything streamed so far
        self._mode: str | None = None  # None until known, then "calls" or "content"
        self._consumed = 0  # in calls mode: characters of the body already made calls
        self._num_calls = 0

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = _strip_tag(text)
        if not body.startswith("{"):
            return ExtractedToolCalls(content=text, tool_calls=[])
        calls, rest = _decode_calls(body)
        if not calls:
            return ExtractedToolCalls(content=text, tool_calls=[])
        return ExtractedToolCalls(content=rest.strip() or None, tool_calls=calls)

    def extract_tool_calls_streaming(self, delta_text: str) -> tuple[str, list[ToolCall]]:
        self._raw += delta_text
        if self._mode == "content":
            return delta_text, []
        if self._mode is None:
            head = self._raw.lstrip()
            if not head or partial_marker_len(head, PYTHON_TAG) == len(head):
                return "", []  # could still be the tag or leading space before a call
            body = _strip_tag(self._raw)
            if not body:
                return "", []
            if not body.startswith("{"):
                self._mode = "content"
                return self._raw, []
            self._mode = "calls"
        body = _strip_tag(self._raw)
        calls, rest = _decode_calls(body[self._consumed :])
        if calls:
            self._consumed = len(body) - len(rest)
            self._num_calls += len(calls)
        return "", calls

    def finish_streaming(self) -> tuple[str, list[ToolCall]]:
        if self._mode == "content":
            return "", []
        if self._mode is None:
            return self._raw, []
        rest = _strip_tag(self._raw)[self._consumed :]
        if self._num_calls == 0:
            return self._raw, []  # never a call: all of it was content
        return rest.strip(), []


@hookimpl
def register_tool_parsers(register):
    register("llama3_json", Llama3JsonToolParser)
