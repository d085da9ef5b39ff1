"""Speculative decoding: a proposer guesses the tokens a request will generate next; the
target model checks them all in one forward pass and keeps the longest prefix it agrees
with (the engine's rejection sampler), so one pass can land several tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class DraftRequest:
    """One request a proposer is asked to guess for at this step."""

    request_id: str
    # Prompt then output so far (the engine's own list: read it, never change it).
    token_ids: Sequence[int]
    num_prompt_tokens: int
    # At most this many tokens may be proposed (the stack's `num_tokens`, fewer near the
    # request's max_tokens or max_model_len, or when the step's token budget is short).
    max_num_tokens: int


@runtime_checkable
class SpecProposer(Protocol):
    """Proposes draft tokens for decoding requests, once per step, in the engine-core
    process. A proposer with nothing to propose returns an empty list for that request:
    the request then decodes one token as it would without speculation, at no cost."""

    def __init__(self, *, num_tokens: int, vocab_size: int) -> None:
        """`num_tokens`: the most tokens a proposal may hold (stack.speculative.num_tokens);
        `vocab_size`: the target model's logits width (every proposed id is below it)."""
        ...

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """One proposal per request, in order: token ids the target model is likely to
        generate next, at most that request's `max_num_tokens` of them (maybe none)."""
        ...

    def request_finished(self, request_id: str) -> None:
        """The request is gone (finished or aborted): drop what is kept for it. A
        preempted request is not finished; it is asked about again when it resumes."""
        ...
