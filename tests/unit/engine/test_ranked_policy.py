"""RankedPolicy: a scheduling policy written as its rank function alone. Lower ranks run
first, equal ranks in arrival order; the running request ranked last yields first."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from plugserve.datatypes import Request
from plugserve.interfaces.scheduling import RankedPolicy, SchedulingPolicy
from plugserve.sampling_params import SamplingParams


class ByPromptLength(RankedPolicy):
    def rank(self, request: Request) -> int:
        return request.num_prompt_tokens


def request(request_id: str, prompt_len: int, arrival: float) -> Request:
    return Request(request_id, [7] * prompt_len, SamplingParams(), None, arrival_time=arrival)


def ids(requests: Iterable[Request]) -> list[str]:
    return [r.request_id for r in requests]


def test_it_is_a_scheduling_policy_once_it_has_a_rank() -> None:
    assert isinstance(ByPromptLength(), SchedulingPolicy)
    with pytest.raises(TypeError, match="rank"):
        RankedPolicy()  # type: ignore[abstract]


def test_waiting_requests_run_lowest_rank_first_and_equal_ranks_in_arrival_order() -> None:
    policy = ByPromptLength()
    for r in [request("long", 9, 1.0), request("short-late", 2, 3.0), request("short", 2, 2.0)]:
        policy.add(r)

    assert ids(policy) == ["short", "short-late", "long"]
    assert policy.peek().request_id == "short" and len(policy) == 3
    assert [policy.pop().request_id for _ in range(3)] == ["short", "short-late", "long"]
    assert len(policy) == 0


def test_requests_equal_in_rank_and_arrival_leave_in_the_order_they_joined() -> None:
    policy = ByPromptLength()
    for name in ["first", "second", "third"]:
        policy.add(request(name, 4, 1.0))

    assert [policy.pop().request_id for _ in range(3)] == ["first", "second", "third"]


def test_a_preempted_request_rejoins_ahead_of_later_arrivals_of_its_rank() -> None:
    policy = ByPromptLength()
    early = request("early", 4, 1.0)
    policy.add(early)
    assert policy.pop() is early  # admitted
    policy.add(request("later", 4, 2.0))
    policy.add(request("shorter", 3, 3.0))

    policy.prepend(early)  # preempted

    assert ids(policy) == ["shorter", "early", "later"]


def test_removed_requests_leave_the_queue_wherever_they_are() -> None:
    policy = ByPromptLength()
    waiting = [request(f"r{n}", n, float(n)) for n in range(1, 6)]
    for r in waiting:
        policy.add(r)

    policy.remove([waiting[0], waiting[3]])

    assert ids(policy) == ["r2", "r3", "r5"]
    assert policy.pop().request_id == "r2"


def test_the_running_request_ranked_last_is_the_victim_the_latest_arrival_among_equals() -> None:
    policy = ByPromptLength()
    running = [request("long-early", 9, 1.0), request("long-late", 9, 2.0), request("s", 2, 3.0)]

    assert policy.select_victim(running).request_id == "long-late"
    assert policy.select_victim(running[::-1]).request_id == "long-late"
