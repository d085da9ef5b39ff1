"""Request: the engine core's record of one generation, owned by the scheduler."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from typing import Any

from plugserve.datatypes.runner_output import Logprobs
from plugserve.pooling_params import PoolingParams
from plugserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Its structured-output grammar is being compiled off the busy loop; it joins the
    # waiting queue when the grammar is ready (vLLM's WAITING_FOR_FSM).
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    PREEMPTED = 3
    # Everything from here on is finished.
    FINISHED_STOPPED = 4  # EOS, a stop token, or the grammar's end
    FINISHED_LENGTH = 5  # max_tokens or max_model_len
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Prompt and output ids plus how far the model has computed them.

    `num_computed_tokens` counts the tokens whose KV is in the cache; the tokens still to
    compute are `all_token_ids[num_computed_tokens:]`. A preempted request drops back to
    zero and is recomputed (its prefix-cached blocks usually survive).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        # A pooling request: it finishes once its prompt has run, with its pooled output.
        self.pooling_params = pooling_params
        self.pooled: Any = None  # its PooledTensor, once computed
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 = not yet
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_in_request = False  # see EngineCoreOutput.error_in_request
        # Set when the request's last bitmask row allowed no token at all.
        self.grammar_dead_end = False
        # Structured output: the compilation under way, then the request's own grammar
        # (interfaces.structured_output.Grammar), advanced by every token it accepts.
        self.grammar_future: Future[Any] | None = None
        self.grammar: Any = None
        # Reasoning (sampling_params.reasoning): still inside it, how many of its tokens are
        # out, and the end-marker ids the thinking budget still has to force, in order.
        self.in_reasoning = sampling_params.reasoning is not None
        self.num_reasoning_tokens = 0
        self.forced_token_ids: list[int] = []
        # prompt_logprobs: what the prefill chunks computed so far (prompt tokens 2..N).
        self.prompt_logprobs: list[Logprobs] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
