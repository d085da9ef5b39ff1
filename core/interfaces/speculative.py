"""Speculative decoding: a proposer guesses the tokens a request will generate next; the
target model checks them all in one forward pass and keeps the longest prefix it agrees
with (the engine's rejection sampler), so one pass can land several tokens.

A proposer runs in one of two places. A SpecProposer proposes in the engine-core process
at the start of each step, from the tokens the engine holds (n-gram lookup, suffix
matching). A proposer with the ProposesInWorker capability (plugserve.capabilities)
proposes in the model runner, on every rank, right after each step's sampling, with a
model of its own the runner loads and runs beside the target (a draft model): its drafts
travel back with the step's output, so they cost no extra round trip, and the engine
schedules them in the next step exactly as a SpecProposer's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch


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


@dataclass(frozen=True)
class WorkerDraftRequests:
    """The requests a worker-side proposer guesses for after a step: those that sampled a
    token in it, in the batch's order."""

    req_ids: list[str]
    # int64, per request: its newest token (just sampled; not yet in any KV cache) and
    # that token's position.
    token_ids: np.ndarray
    positions: np.ndarray
    # int64, per request: at most this many tokens may be proposed (the KV slots its
    # blocks hold from the newest token's position on, or the context's end, or fewer).
    max_num_tokens: np.ndarray


@runtime_checkable
class ProposerModel(Protocol):
    """A model the model runner loaded for a worker-side proposer, run on every rank.

    Its KV cache is its own, in blocks with the target's block ids: a request's entries
    are allocated, freed and rolled back with the target's, and the runner keeps them
    caught up with every token the target computes (prompt chunks, verified drafts, a
    prompt recomputed after preemption). Positions past the request's computed tokens
    are scratch: a proposer writes its guesses' entries there, and the next step
    overwrites them with the tokens actually chosen."""

    vocab_size: int

    def decode(
        self, req_ids: Sequence[str], token_ids: np.ndarray, positions: np.ndarray
    ) -> torch.Tensor | None:
        """Run one token per request at its position (int64 arrays, one entry per
        request; its KV entry is written there, and it attends to the request's entries
        before it): the model's fp32 logits [len(req_ids), vocab_size] on the driver
        rank, None on the other tensor-parallel ranks."""
        ...

    def share(self, token_ids: np.ndarray) -> np.ndarray:
        """The driver rank's int64 `token_ids` on every rank (as they are, without tensor
        parallelism): every rank must feed the next `decode` the same tokens."""
        ...


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
