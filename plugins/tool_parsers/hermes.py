"""The `hermes` tool parser: Hermes and Qwen (2, 2.5, 3) models write each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is the message content. A call whose JSON does not parse stays
in the content, as written, so that nothing the model said is lost.
"""

from __future__ import annotations

import json
import re
from typing import Any

from plugserve import hookimpl
from plugserve.interfaces.frontend import ExtractedToolCalls, ToolCall

from ._common import call_from_object, partial_marker_len

START = "<tool_call>"
END = "</tool_call>"
_CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)
_ARGUMENT_KEYS = ("arguments", "parameters")


def _parse_call(body: str) -> ToolCall | None:
    try:
        return call_from_object(json.loads(body), _ARGUMENT_KEYS)
    except json.JSONDecodeError:
        return None


class HermesToolParser:
    def __init__(self, *, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        self.tools = tools
        self._buffer = ""  # streamed text not yet returned
        self._in_call = False

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        content: list[str] = []
        position = 0
        for match in _CALL.finditer(text):
            call = _parse_call(match.group(1))
            if call is None:
                continue  # stays in the content
            content.append(text[position : match.start()])
            calls.append(call)
            position = match.end()
        content.append(text[position:])
        if not calls:
            return ExtractedToolCalls(content=text, tool_calls=[])
        rest = "".join(content).strip()
        return ExtractedToolCalls(content=rest or None, tool_calls=calls)

    def extract_tool_calls_streaming(self, delta_text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += delta_text
        shown: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(END)
                if end < 0:
                    break
                body = self._buffer[:end]
                call = _parse_call(body)
                if call is None:  # not a call after all: show it as written
                    shown.append(START + body + END)
                else:
                    calls.append(call)
                self._buffer = self._buffer[end + len(END) :]
                self._in_call = False
                continue
            start = self._buffer.find(START)
            if start < 0:
                keep = partial_marker_len(self._buffer, START)
                shown.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            shown.append(self._buffer[:start])
            self._buffer = self._buffer[start + len(START) :]
            self._in_call = True
        return "".join(shown), calls

    def finish_streaming(self) -> tuple[str, list[ToolCall]]:
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return rest, []
        self._in_call = False
        call = _parse_call(rest)  # a last call the model did not close
        return ("", [call]) if call is not None else (START + rest, [])


@hookimpl
def register_tool_parsers(register):
    register("hermes", HermesToolParser)
