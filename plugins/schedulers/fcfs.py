"""First come, first served: admit in arrival order, preempt the latest admitted."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from plugserve import hookimpl
from plugserve.datatypes import Request


class FCFSPolicy:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        # A preempted request arrived before everything still waiting.
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def select_victim(self, running: Sequence[Request]) -> Request:
        return running[-1]


@hookimpl
def register_scheduler_policies(register):
    register("fcfs", FCFSPolicy)
