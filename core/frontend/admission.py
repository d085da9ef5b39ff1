"""`engine.max_waiting_requests`: the bound on requests queued for the engines, past
which an API server answers 429 with Retry-After instead of queueing.

Decided in the API server, before a request is rendered into the engines' queues, from
what this API server has in flight: an engine runs at most `max_num_seqs` requests and
every further one waits, so this API server admits at most
`num_engines × (max_num_seqs + max_waiting_requests)` engine requests at once (a request
with n choices or several prompts counts each). The engines need no new message and
a refused request never costs them anything. With several API servers each bounds its
own requests at its share of that (connections are spread evenly over them).
The bound counts requests as slots; one that waits for KV blocks rather than a slot is
within it.
"""

from __future__ import annotations

import math
import weakref

RETRY_AFTER_S = 1  # what a refused client is told to wait: about one batch's turn


class Overloaded(RuntimeError):
    """The queue is full: answered with 429 and Retry-After."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Admission:
    """Counts this API server's engine requests in flight and refuses past the bound."""

    def __init__(
        self,
        max_waiting_requests: int | None,
        *,
        max_num_seqs: int,
        num_engines: int = 1,
        api_server_count: int = 1,
    ) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.in_flight = 0
        if max_waiting_requests is None:
            self.capacity: int | None = None
        else:
            per_engine = max_num_seqs + max_waiting_requests
            self.capacity = math.ceil(num_engines * per_engine / api_server_count)

    def acquire(self, count: int) -> Slot:
        """Take `count` engine requests' slots; Overloaded if they do not fit. The slot is
        held until released (idempotent)."""
        if self.capacity is not None and self.in_flight + count > self.capacity:
            raise Overloaded(
                f"the server is at capacity ({self.in_flight} requests in flight, at most "
                f"{self.max_waiting_requests} waiting per engine); retry later"
            )
        self.in_flight += count
        return Slot(self, count)


class Slot:
    def __init__(self, admission: Admission, count: int) -> None:
        self._admission: Admission | None = admission
        self.count = count

    def release(self) -> None:
        if self._admission is not None:
            self._admission.in_flight -= self.count
            self._admission = None

    def release_with(self, owner: object) -> None:
        """Release when `owner` (a response's body iterator) is collected too: a stream
        whose client left before its first byte is never iterated, so never finishes."""
        weakref.finalize(owner, self.release)
