"""EngineCore: the scheduler and the executor, stepped together (phases 5–9).

Every part comes from the plugin registry by the name stack.yaml gives; the engine
never branches on which one it got.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import msgspec

from plugserve.config import StackConfig
from plugserve.datatypes import Request, RequestStatus
from plugserve.engine.scheduler import Scheduler
from plugserve.interfaces import Executor, KVCacheInfo
from plugserve.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from plugserve.plugins import get_registry

logger = logging.getLogger(__name__)


class StepStats(msgspec.Struct, kw_only=True):
    """One step's figures, passed to `engine_step_finished` observers."""

    num_scheduled_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float
    step_time: float  # seconds, schedule through update
    forward_time: float  # seconds in execute_model + sample_tokens


class EngineCore:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        registry = get_registry(config.disabled_plugins)
        self._registry = registry
        stack = config.stack
        self.executor: Executor = registry.build(
            "executor", stack.executor, config.plugin_options(stack.executor), config=config
        )
        info = self.executor.initialize()
        capacity = info.num_blocks * info.block_size
        if capacity < info.max_model_len:
            # A request longer than the whole pool could never be scheduled: it would
            # wait forever while the loop spins. Cap the context at what the pool holds.
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len %d: capping "
                "max_model_len at %d (raise kv_cache_memory or num_kv_blocks to avoid this)",
                capacity,
                info.max_model_len,
                capacity,
            )
            info = dataclasses.replace(info, max_model_len=capacity)
        self.kv_cache_info: KVCacheInfo = info
        kv_allocator = registry.build(
            "kv_allocator",
            stack.kv_allocator,
            config.plugin_options(stack.kv_allocator),
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            enable_prefix_caching=config.engine.enable_prefix_caching,
        )
        policy = registry.build(
            "scheduler", stack.scheduler, config.plugin_options(stack.scheduler)
        )
        self.scheduler = Scheduler(
            policy=policy,
            kv_allocator=kv_allocator,
            max_num_seqs=config.engine.max_num_seqs,
            max_num_batched_tokens=config.engine.max_num_batched_tokens,
            max_model_len=info.max_model_len,
            on_finished=self._notify_finished
            if registry.has_observers("request_finished")
            else None,
        )
        self._observe_steps = registry.has_observers("engine_step_finished")
        self.num_steps = 0
        self.step_seconds = 0.0
        self.forward_seconds = 0.0
        logger.info(
            "engine ready: %d KV blocks of %d tokens, dtype %s, max_model_len %d",
            info.num_blocks,
            info.block_size,
            info.dtype,
            info.max_model_len,
        )

    @property
    def max_model_len(self) -> int:
        return self.kv_cache_info.max_model_len

    # ------------------------------------------------------------------ requests

    def add_request(self, req: EngineCoreRequest) -> None:
        """Validate and queue a request; a bad one raises ValueError and changes nothing."""
        num_prompt = len(req.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens; max_model_len is {self.max_model_len} "
                "and at least one token must be left to generate"
            )
        self.scheduler.add_request(
            Request(
                request_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                sampling_params=req.sampling_params,
                eos_token_id=req.eos_token_id,
                arrival_time=req.arrival_time,
                priority=req.priority,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [
            EngineCoreOutput(request_id=r.request_id, new_token_ids=[], finish_reason="abort")
            for r in aborted
        ]

    def stats(self) -> SchedulerStats:
        """The scheduler's figures plus the engine's step counters."""
        stats = self.scheduler.stats()
        stats.num_steps = self.num_steps
        stats.step_seconds = self.step_seconds
        stats.forward_seconds = self.forward_seconds
        return stats

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    # ------------------------------------------------------------------ the step

    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """One pass: schedule, forward, sample, update. Returns the outputs and whether
        any token was computed."""
        if not self.scheduler.has_requests():
            return [], False
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        forward_started = time.perf_counter()
        future = self.executor.execute_model(scheduler_output, non_block=True)
        # Structured-output grammar bitmasks would be computed here, overlapping the
        # forward pass; there are none yet.
        grammar_output = None
        model_output = future.result() if hasattr(future, "result") else future
        if model_output is None:
            model_output = self.executor.sample_tokens(grammar_output)
        forward_time = time.perf_counter() - forward_started
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        step_time = time.perf_counter() - started
        self.num_steps += 1
        self.step_seconds += step_time
        self.forward_seconds += forward_time
        if self._observe_steps:  # built only for them: every call counts at batch 1
            stats = self.scheduler.stats()
            self._registry.hook.engine_step_finished(
                stats=StepStats(
                    num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
                    num_running=stats.num_running,
                    num_waiting=stats.num_waiting,
                    kv_usage=stats.kv_usage,
                    step_time=step_time,
                    forward_time=forward_time,
                )
            )
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def count_output_time(self, seconds: float) -> None:
        """Time the caller spent handing a step's outputs on after step() returned (the
        engine process sends them from its busy loop on a CPU): step time, and overhead."""
        self.step_seconds += seconds

    def _notify_finished(self, request: Request) -> None:
        self._registry.hook.request_finished(
            request_id=request.request_id,
            finish_reason=request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
