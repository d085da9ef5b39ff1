"""Priority scheduling: lower `priority` value first, arrival time breaks ties; the
request with the worst (priority, arrival) is preempted first."""

from __future__ import annotations

from plugserve import hookimpl
from plugserve.datatypes import Request
from plugserve.interfaces.scheduling import RankedPolicy


class PriorityPolicy(RankedPolicy):
    def rank(self, request: Request) -> int:
        return request.priority


@hookimpl
def register_scheduler_policies(register):
    register("priority", PriorityPolicy)
