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
from plugserve.engine.structured_output import StructuredOutputManager
from plugserve.interfaces import Executor, KVCacheInfo
from plugserve.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from plugserve.plugins import get_registry

logger = logging.getLogger(__name__)

# A step's forward pass hid its grammar bitmask when the engine still waited this long for
# the executor's result after the bitmask was done (reading a finished result takes less).
HIDDEN_WAIT_S = 1e-4


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
        # Builds its backend on the first constrained request only.
        self.structured_output = StructuredOutputManager(config, registry=registry)
        self.scheduler = Scheduler(
            policy=policy,
            kv_allocator=kv_allocator,
            max_num_seqs=config.engine.max_num_seqs,
            max_num_batched_tokens=config.engine.max_num_batched_tokens,
            max_model_len=info.max_model_len,
            on_finished=self._notify_finished
            if registry.has_observers("request_finished")
            else None,
            structured_output=self.structured_output,
        )
        self._observe_steps = registry.has_observers("engine_step_finished")
        self.num_steps = 0
        self.step_seconds = 0.0
        self.forward_seconds = 0.0
        self.grammar_bitmask_steps = 0
        self.grammar_bitmask_seconds = 0.0
        self.grammar_forward_wait_seconds = 0.0
        self.grammar_bitmask_hidden_steps = 0
        # When each request was queued, until first scheduled; then the seconds it waited,
        # until its first output carries them (EngineCoreOutput.queue_seconds).
        self._queued_at: dict[str, float] = {}
        self._queue_seconds: dict[str, float] = {}
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
        self._queued_at[req.request_id] = time.monotonic()

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self._queued_at.pop(request_id, None)
            self._queue_seconds.pop(request_id, None)
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
        stats.grammar_bitmask_steps = self.grammar_bitmask_steps
        stats.grammar_bitmask_seconds = self.grammar_bitmask_seconds
        stats.grammar_forward_wait_seconds = self.grammar_forward_wait_seconds
        stats.grammar_bitmask_hidden_steps = self.grammar_bitmask_hidden_steps
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
        if self._queued_at:
            now = time.monotonic()
            for new_request in scheduler_output.scheduled_new_reqs:
                queued_at = self._queued_at.pop(new_request.req_id, None)
                if queued_at is not None:  # not a preempted request coming back
                    self._queue_seconds[new_request.req_id] = now - queued_at
        future = self.executor.execute_model(scheduler_output, non_block=True)
        # The grammar bitmask of the constrained requests that sample this step, built on
        # the CPU while the forward pass runs (where the executor runs it elsewhere).
        grammar_output = None
        constrained = self.scheduler.constrained_sampling(scheduler_output)
        if constrained:
            bitmask_started = time.perf_counter()
            grammar_output = self.structured_output.grammar_output(constrained)
            bitmask_done = time.perf_counter()
            self.grammar_bitmask_steps += 1
            self.grammar_bitmask_seconds += bitmask_done - bitmask_started
        model_output = future.result() if hasattr(future, "result") else future
        if constrained:
            waited = time.perf_counter() - bitmask_done
            self.grammar_forward_wait_seconds += waited
            # Still waiting for the forward pass after the bitmask: it hid all of it.
            if waited > HIDDEN_WAIT_S:
                self.grammar_bitmask_hidden_steps += 1
        if model_output is None:
            model_output = self.executor.sample_tokens(grammar_output)
        forward_time = time.perf_counter() - forward_started
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if self._queue_seconds or self._queued_at:
            self._attach_queue_times(outputs)
        if not scheduler_output.total_num_scheduled_tokens and not outputs:
            # Nothing could run: the requests left wait for their grammars. Wait for one
            # to compile rather than spin (new input is looked at again within 10 ms).
            self.scheduler.wait_for_grammars(timeout=0.01)
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

    def _attach_queue_times(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            queue_seconds = self._queue_seconds.pop(output.request_id, None)
            if queue_seconds is not None:
                output.queue_seconds = queue_seconds
            elif output.finished:  # it never ran (a grammar that failed to compile)
                self._queued_at.pop(output.request_id, None)

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
        self.structured_output.shutdown()
        self.executor.shutdown()
