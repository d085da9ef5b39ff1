"""Shortest-prompt-first scheduling, and an observer that records finished requests.

Written only against plugserve's public surface: `plugserve.hookimpl`, the ranked-policy
base `plugserve.interfaces.scheduling.RankedPolicy`, the Request attributes the SchedulingPolicy
protocol documents, and the observer hook's arguments.
"""

from __future__ import annotations

import json
import os

from plugserve import hookimpl
from plugserve.datatypes import Request
from plugserve.interfaces.scheduling import RankedPolicy


class ShortestPromptFirst(RankedPolicy):
    """Waiting requests ordered by prompt length; the longest running one yields first."""

    def rank(self, request: Request) -> int:
        # Short prompts first: they finish their prefill soonest and free the queue.
        return request.num_prompt_tokens


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
