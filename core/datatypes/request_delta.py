"""What the API server's engine client yields for one request (phase 11): the endpoints
stream it, an endpoint plugin included."""

from __future__ import annotations

from dataclasses import dataclass

from plugserve.datatypes.runner_output import Logprobs


@dataclass
class RequestDelta:
    """What one engine step added to one request, as the serving layer streams it."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int  # so far, including this delta
    num_cached_tokens: int
    # With the first delta of a request that asked for prompt_logprobs: one entry per
    # prompt token, None for the first.
    prompt_logprobs: list[Logprobs | None] | None = None
    # Output tokens so far inside the reasoning, its end marker included (0 without a
    # reasoning parser): usage's completion_tokens_details.reasoning_tokens.
    num_reasoning_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
