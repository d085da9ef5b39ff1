"""One chat choice's output as content and OpenAI tool calls, by `tool_choice`.

- "none" (or no tools): the text is the content.
- a named function: the output, generated under the function's parameters schema, is
  that function's arguments; streamed as they come.
- "required": the output, generated under an array-of-calls schema, is a list of
  `{"name": …, "parameters": {…}}`; each call is streamed when its object closes.
- "auto": the stack's tool parser finds calls in the model family's own format.

Non-streamed, `final(text)` gives the message's content and tool_calls; streamed,
`feed(text)` and `finish()` give the `delta` objects of the chunks to send, in order, as
OpenAI sends them: a call's id, type and name first (arguments ""), then its arguments.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from plugserve.interfaces.frontend import ToolCall, ToolParser

Delta = dict[str, Any]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_tool_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class ChoiceOutput:
    """Plain text: everything is content ("none", or no tools)."""

    def __init__(self) -> None:
        self.num_calls = 0  # calls streamed so far

    def final(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return text, []

    def feed(self, text: str) -> list[Delta]:
        return [{"content": text}] if text else []

    def finish(self) -> list[Delta]:
        return []

    def _call_deltas(self, call: ToolCall) -> list[Delta]:
        index = self.num_calls
        self.num_calls += 1
        head = {
            "index": index,
            "id": new_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        deltas: list[Delta] = [{"tool_calls": [head]}]
        if call.arguments:
            arguments = {"index": index, "function": {"arguments": call.arguments}}
            deltas.append({"tool_calls": [arguments]})
        return deltas


class NamedCall(ChoiceOutput):
    """tool_choice names a function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def final(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return None, [message_tool_call(ToolCall(self.name, text))]

    def feed(self, text: str) -> list[Delta]:
        if self.num_calls == 0:
            return self._call_deltas(ToolCall(self.name, text))
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []

    def finish(self) -> list[Delta]:
        return self.feed("") if self.num_calls == 0 else []


class RequiredCalls(ChoiceOutput):
    """tool_choice "required": the output is a JSON array of calls."""

    def __init__(self) -> None:
        super().__init__()
        self._items = _ArrayItems()

    def final(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        try:
            items = json.loads(text)
        except json.JSONDecodeError:  # cut short (length): the calls that closed
            items = [_loads(item) for item in _ArrayItems().feed(text)]
        calls = [c for c in map(_call_of, items if isinstance(items, list) else []) if c]
        if not calls:
            return text, []
        return None, [message_tool_call(c) for c in calls]

    def feed(self, text: str) -> list[Delta]:
        deltas: list[Delta] = []
        for item in self._items.feed(text):
            call = _call_of(_loads(item))
            if call is not None:
                deltas += self._call_deltas(call)
        return deltas


class AutoCalls(ChoiceOutput):
    """tool_choice "auto": the model decides; the stack's tool parser finds its calls.

    Streamed, whitespace that ends the content so far is held back until more content
    follows: the newlines a model writes around its calls are not content, as they are
    not in the non-streamed message (whose content the parser strips)."""

    def __init__(self, parser: ToolParser, *, parallel: bool = True) -> None:
        """Without `parallel` (parallel_tool_calls false) a model that writes several
        calls gets the first only, as the request allows one."""
        super().__init__()
        self.parser = parser
        self.max_calls = None if parallel else 1
        self._space = ""

    def final(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        extracted = self.parser.extract_tool_calls(text)
        calls = extracted.tool_calls[: self.max_calls]
        return extracted.content, [message_tool_call(c) for c in calls]

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(*self.parser.extract_tool_calls_streaming(text))

    def finish(self) -> list[Delta]:
        deltas = self._deltas(*self.parser.finish_streaming())
        if self._space and self.num_calls == 0:  # plain text keeps its ending
            deltas.append({"content": self._space})
        return deltas

    def _deltas(self, content: str, calls: list[ToolCall]) -> list[Delta]:
        text = self._space + content
        shown = text.rstrip()
        self._space = text[len(shown) :]
        deltas: list[Delta] = [{"content": shown}] if shown else []
        for call in calls:
            if self.max_calls is None or self.num_calls < self.max_calls:
                deltas += self._call_deltas(call)
        return deltas


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call_of(item: Any) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    parameters = item.get("parameters", item.get("arguments", {}))
    return ToolCall(item["name"], json.dumps(parameters, ensure_ascii=False))


class _ArrayItems:
    """The top-level items of a JSON array of objects, each returned once it closes, as
    the array's text streams in (strings and escapes followed, so braces in strings do
    not count)."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.item_start = -1

    def feed(self, text: str) -> list[str]:
        items = []
        start = len(self.text)
        self.text += text
        for i in range(start, len(self.text)):
            ch = self.text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.item_start = i
            elif ch in "]}":
                if self.depth == 2 and self.item_start >= 0:
                    items.append(self.text[self.item_start : i + 1])
                    self.item_start = -1
                self.depth -= 1
        return items
