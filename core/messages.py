"""msgspec Structs that cross the process boundary between API server and engine core.

array_like and omit_defaults keep the hot messages (one EngineCoreOutputs per step) small.
"""

from __future__ import annotations

import time

import msgspec

from plugserve.sampling_params import SamplingParams
from plugserve.worker.model_runner_output import Logprobs


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = msgspec.field(default_factory=time.time)
    priority: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id that ended it
    new_logprobs: list[Logprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
