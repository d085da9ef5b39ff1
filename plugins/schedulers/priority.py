"""Priority scheduling: lower `priority` value first, arrival time breaks ties; the
request with the worst (priority, arrival) is preempted first."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence

from plugserve import hookimpl
from plugserve.datatypes import Request


def _rank(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


class PriorityPolicy:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*_rank(request), next(self._tiebreak), request))

    # Arrival time already keeps a preempted request ahead of later arrivals.
    prepend = add

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=_rank)


@hookimpl
def register_scheduler_policies(register):
    register("priority", PriorityPolicy)
