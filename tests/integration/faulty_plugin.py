"""A test plugin: the scheduler policy "faulty", first come first served except that it
refuses any request of priority 13 with a ValueError, an engine-side error confined to
one request.

Loaded by the server under test through PLUGSERVE_PLUGIN_MODULES (the spawned engine
inherits it), so it must stay importable as `tests.integration.faulty_plugin` from the
repository root.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from plugserve import hookimpl
from plugserve.datatypes import Request
from plugserve_plugins.schedulers.fcfs import FCFSPolicy

UNLUCKY_PRIORITY = 13


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


@hookimpl
def register_scheduler_policies(register):
    register("faulty", FaultyPolicy)
