"""What the scheduler tells the executor each step (phase 5 → 7).

Requests new to the model runner's persistent batch carry everything; requests already
in it carry only what changed. msgspec Structs, so a multi-process executor can ship
them to its workers as they are.
"""

from __future__ import annotations

import msgspec

from plugserve.pooling_params import PoolingParams
from plugserve.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request entering the persistent batch: first scheduled, or resumed after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only for a request resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # set for a pooling request


class CachedRequestData(msgspec.Struct, kw_only=True):
    """Requests already in the persistent batch: only their new blocks and progress."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    # With speculative decoding: how many of its blocks each request keeps before
    # new_block_ids are appended (blocks past its tokens may have been freed); empty
    # without: every block is kept.
    num_kept_blocks: list[int] = msgspec.field(default_factory=list)


class SchedulerOutput(msgspec.Struct, kw_only=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens computed this step; the sum is the step's share of the token budget.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests to drop from the persistent batch since the last step: finished or
    # aborted ones, and preempted ones (which come back later as new requests).
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = msgspec.field(default_factory=set)
    # Speculative decoding: req_id -> the draft tokens scheduled after its next token
    # (counted in num_scheduled_tokens). The runner computes logits at every one of
    # those positions and returns the accepted drafts plus one token of its own.
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)

    @classmethod
    def empty(cls, finished_req_ids: set[str] | None = None) -> SchedulerOutput:
        return cls(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            finished_req_ids=finished_req_ids or set(),
        )
