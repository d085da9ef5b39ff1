"""What the executor hands back after sampling (phase 8 → 9)."""

from __future__ import annotations

import msgspec

from plugserve.datatypes.pooled_tensor import PooledTensor


class Logprobs(msgspec.Struct, array_like=True):
    """Per sampled token: the sampled token's logprob and rank, then the top-N alternatives."""

    sampled_logprob: float
    sampled_rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    # One entry per request that sampled this step; a request still in chunked prefill
    # samples nothing and is absent.
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[Logprobs]] = msgspec.field(default_factory=dict)
    # Requests that asked for prompt logprobs and computed prompt tokens this step: one
    # entry per prompt token from the second on (the logprob of that token given those
    # before it), in order; a chunked prefill's chunks add to it step by step.
    prompt_logprobs: dict[str, list[Logprobs]] = msgspec.field(default_factory=dict)
    # Requests whose step failed alone (bad input reaching the worker, for example);
    # they finish with an error while the rest of the batch goes on.
    errors: dict[str, str] = msgspec.field(default_factory=dict)
    # A pooling model's step: the requests whose last prompt chunk ran, with their pooled
    # output (returned by execute_model itself; nothing is sampled).
    pooled: dict[str, PooledTensor] = msgspec.field(default_factory=dict)
    # Speculative decoding with a proposer that runs in the worker: req_id -> the tokens
    # it guesses follow the one this step sampled (to be verified at the next step).
    draft_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Under pipeline parallelism: each stage's seconds of work so far (its first rank's),
    # carried from stage to stage with the activations; the engine's counters keep them.
    stage_busy_seconds: list[float] | None = None
