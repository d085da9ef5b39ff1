"""A test plugin: the scheduler policy "faulty", first come first served except that it
refuses any request of priority 13 with a ValueError, an engine-side error confined to
one request; and the tool parser "faulty", which raises while the API server renders the
answer of any request that offers tools with `tool_choice: "auto"`, an API-server-side
error in one request.

Loaded by the server under test through PLUGSERVE_PLUGIN_MODULES (the spawned engine
inherits it), so it must stay importable as `tests.integration.faulty_plugin` from the
repository root.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from plugserve import hookimpl
from plugserve.datatypes import Request
from plugserve_plugins.schedulers.fcfs import FCFSPolicy

UNLUCKY_PRIORITY = 13
TOOL_PARSER_ERROR = "the faulty tool parser fails while the answer is rendered"


class FaultyPolicy:
    """FCFS, composed: every call goes to the wrapped policy once `add` has let the
    request through."""

    def __init__(self) -> None:
        self._inner = FCFSPolicy()

    def add(self, request: Request) -> None:
        if request.priority == UNLUCKY_PRIORITY:
            raise ValueError(f"the faulty policy refuses priority {UNLUCKY_PRIORITY}")
        self._inner.add(request)

    def prepend(self, request: Request) -> None:
        self._inner.prepend(request)

    def peek(self) -> Request:
        return self._inner.peek()

    def pop(self) -> Request:
        return self._inner.pop()

    def remove(self, requests: Iterable[Request]) -> None:
        self._inner.remove(requests)

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._inner)

    def select_victim(self, running: Sequence[Request]) -> Request:
        return self._inner.select_victim(running)


class FaultyToolParser:
    """Raises in each of the parser's calls: the bug in a plugin that a route cannot
    foresee (the interface's methods raise nothing)."""

    def __init__(self, *, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        pass

    def extract_tool_calls(self, text: str) -> Any:
        raise RuntimeError(TOOL_PARSER_ERROR)

    def extract_tool_calls_streaming(self, delta_text: str) -> Any:
        raise RuntimeError(TOOL_PARSER_ERROR)

    def finish_streaming(self) -> Any:
        raise RuntimeError(TOOL_PARSER_ERROR)


@hookimpl
def register_scheduler_policies(register):
    register("faulty", FaultyPolicy)


@hookimpl
def register_tool_parsers(register):
    register("faulty", FaultyToolParser)
