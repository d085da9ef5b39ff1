"""Which waiting request runs next and which running one gives way: the policy slot, and
RankedPolicy, a base on which a policy is only its rank function.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from plugserve.datatypes import Request


@runtime_checkable
class SchedulingPolicy(Protocol):
    """The waiting queue's order, and whom to preempt when KV blocks run out."""

    def __init__(self) -> None: ...

    def add(self, request: Request) -> None:
        """A newly arrived request joins the waiting queue."""
        ...

    def prepend(self, request: Request) -> None:
        """A preempted request rejoins; it should not lose its place to later arrivals."""
        ...

    def peek(self) -> Request:
        """The next request to admit (the queue is not empty)."""
        ...

    def pop(self) -> Request: ...

    def remove(self, requests: Iterable[Request]) -> None:
        """Drop aborted requests, wherever they are in the queue."""
        ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...

    def select_victim(self, running: Sequence[Request]) -> Request:
        """Which running request to preempt (recompute) when KV blocks run out. `running`
        holds the running requests not yet scheduled this step, in admission order, the
        one that needs blocks among them; choosing that one makes it give way."""
        ...


class RankedPolicy(ABC):
    """A SchedulingPolicy that is its rank function: a subclass defines only `rank`.

    Waiting requests run lowest rank first, equal ranks in arrival order; a preempted
    request rejoins at the place its rank and arrival give it, ahead of later arrivals of
    its rank. The running request with the highest (rank, arrival) is preempted first."""

    def __init__(self) -> None:
        # (rank, arrival, insertion count, request): the count differs between any two
        # entries, so the heap never compares two Requests.
        self._heap: list[tuple[Any, float, int, Request]] = []
        self._insertions = itertools.count()

    @abstractmethod
    def rank(self, request: Request) -> Any:
        """The request's key, lower runs first: any ordered value (a number, a tuple).
        Read when the request joins the queue and again when a victim is chosen."""

    def _order(self, request: Request) -> tuple[Any, float]:
        return (self.rank(request), request.arrival_time)

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*self._order(request), next(self._insertions), request))

    def prepend(self, request: Request) -> None:
        # Its arrival time already keeps a preempted request ahead of later arrivals.
        self.add(request)

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
        return (entry[-1] for entry in sorted(self._heap, key=lambda entry: entry[:3]))

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=self._order)
