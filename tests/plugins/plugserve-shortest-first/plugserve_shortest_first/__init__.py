"""Shortest-prompt-first scheduling, and an observer that records finished requests.

Written only against plugserve's public surface: `plugserve.hookimpl`, the Request
attributes the SchedulingPolicy protocol documents, and the observer hook's arguments.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence

from plugserve import hookimpl


def _rank(request) -> tuple[int, float]:
    # Short prompts first: they finish their prefill soonest and free the queue.
    return (request.num_prompt_tokens, request.arrival_time)


class ShortestPromptFirst:
    """Waiting requests ordered by prompt length; the longest running one yields first."""

    def __init__(self) -> None:
        self._heap: list = []
        self._tiebreak = itertools.count()

    def add(self, request) -> None:
        heapq.heappush(self._heap, (*_rank(request), next(self._tiebreak), request))

    prepend = add  # a preempted request keeps its place by length and arrival

    def peek(self):
        return self._heap[0][-1]

    def pop(self):
        return heapq.heappop(self._heap)[-1]

    def remove(self, requests: Iterable) -> None:
        gone = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator:
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:3]))

    def select_victim(self, running: Sequence):
        return max(running, key=_rank)


@hookimpl
def register_scheduler_policies(register):
    register("shortest_first", ShortestPromptFirst)


@hookimpl
def request_finished(request_id, finish_reason, num_prompt_tokens, num_output_tokens):
    """Append one JSON line per finished request to $PLUGSERVE_FINISHED_LOG, if set."""
    path = os.environ.get("PLUGSERVE_FINISHED_LOG")
    if not path:
        return
    record = {
        "request_id": request_id,
        "finish_reason": finish_reason,
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
    }
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
