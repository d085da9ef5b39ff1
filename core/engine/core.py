"""EngineCore: the scheduler and the executor, stepped together (phases 5–9 of
docs/request-path.md, whose numbers the phase comments in the code use).

Every part comes from the plugin registry by the name stack.yaml gives; the engine
never branches on which one it got, only on what it can do: an executor that runs
batches concurrently (capabilities.RunsBatchesConcurrently: pipeline stages) gets a
queue of batches in flight instead of one step at a time (`_step_with_batch_queue`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from concurrent.futures import Future

from plugserve.capabilities import RunsBatchesConcurrently, runs_batches_concurrently
from plugserve.config import StackConfig
from plugserve.datatypes import ModelRunnerOutput, Request, RequestStatus, SchedulerOutput
from plugserve.engine.pooling_scheduling import PoolingScheduling
from plugserve.engine.scheduler import Scheduler
from plugserve.engine.speculation import Speculation
from plugserve.engine.step_timer import StepStats, StepTimer
from plugserve.engine.structured_output import StructuredOutputManager, model_vocab_size
from plugserve.interfaces.executor import Executor, KVCacheInfo
from plugserve.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from plugserve.model_files import resolve_model_path
from plugserve.plugins import get_registry
from plugserve.pooling_setup import PoolingSetup, pooling_setup

logger = logging.getLogger(__name__)


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
        self.pooling_setup: PoolingSetup = pooling_setup(
            resolve_model_path(config.model), config.engine.runner, stack.pooler
        )
        kv_allocator = registry.build(
            "kv_allocator",
            stack.kv_allocator,
            config.plugin_options(stack.kv_allocator),
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            # An encoder's prompt runs whole and its layers keep no K/V: no block of it is
            # ever a prefix another request could start from, so none is hashed.
            enable_prefix_caching=config.engine.enable_prefix_caching
            and not self.pooling_setup.is_encoder,
        )
        policy = registry.build(
            "scheduler", stack.scheduler, config.plugin_options(stack.scheduler)
        )
        pooling = None
        if self.pooling_setup.is_pooling:
            pooler = registry.get("pooler", self.pooling_setup.pooler)
            pooling = PoolingScheduling(
                whole_prompts=self.pooling_setup.is_encoder,
                reads_every_token=pooler.tokens == "all",
            )
        # Builds its backend on the first constrained request only.
        self.structured_output = StructuredOutputManager(config, registry=registry)
        self.speculation = Speculation.from_config(
            config,
            registry,
            vocab_size=model_vocab_size(config) if stack.speculative else 0,
            max_model_len=info.max_model_len,
        )
        self._batch_runner: RunsBatchesConcurrently | None = (
            self.executor
            if runs_batches_concurrently(self.executor) and self.executor.max_concurrent_batches > 1
            else None
        )
        self.max_concurrent_batches = (
            1 if self._batch_runner is None else self._batch_runner.max_concurrent_batches
        )
        if self._batch_runner is not None and self.speculation is not None:
            raise ValueError(
                "speculative decoding does not run with pipeline stages (batches in flight): "
                "unset stack.speculative or set pipeline_parallel_size to 1"
            )
        # Batches submitted and not yet returned, oldest first (max_concurrent_batches > 1).
        self._batches: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
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
            speculation=self.speculation,
            pooling=pooling,
            max_concurrent_batches=self.max_concurrent_batches,
        )
        self._observe_steps = registry.has_observers("engine_step_finished")
        self.timer = StepTimer()
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
        if self.pooling_setup.is_pooling or req.pooling_params is not None:
            self._check_pooling_request(req)
        elif num_prompt >= self.max_model_len:
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
                pooling_params=req.pooling_params,
            )
        )
        self.timer.queued(req.request_id)

    def _check_pooling_request(self, req: EngineCoreRequest) -> None:
        setup = self.pooling_setup
        if not setup.is_pooling:
            raise ValueError(f"this {setup.architecture} model generates: it does not pool")
        params = req.pooling_params
        if params is None:
            raise ValueError(f"this {setup.architecture} model pools: it does not generate")
        if params.task not in setup.tasks:
            raise ValueError(
                f"this {setup.architecture} model serves {', '.join(setup.tasks)}, "
                f"not {params.task}"
            )
        sampling = req.sampling_params
        for name, asked in (
            ("structured_outputs", sampling.structured_outputs is not None),
            ("logprobs", sampling.logprobs is not None),
            ("prompt_logprobs", sampling.prompt_logprobs is not None),
            ("reasoning", sampling.reasoning is not None),
            ("n", sampling.n != 1),
        ):
            if asked:
                raise ValueError(
                    f"sampling_params.{name} does not apply to a pooling request, which "
                    "samples nothing"
                )
        num_prompt = len(req.prompt_token_ids)
        if num_prompt > self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens; max_model_len is {self.max_model_len}"
            )
        budget = self.config.engine.max_num_batched_tokens
        if setup.is_encoder and num_prompt > budget:
            raise ValueError(
                f"the prompt has {num_prompt} tokens; an encoder runs a prompt in one step, "
                f"and max_num_batched_tokens is {budget}"
            )

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self.timer.forget(request_id)
        return [
            EngineCoreOutput(request_id=r.request_id, new_token_ids=[], finish_reason="abort")
            for r in aborted
        ]

    def stats(self) -> SchedulerStats:
        """The scheduler's figures plus the engine's step counters."""
        return self.timer.add_counters(self.scheduler.stats())

    def has_requests(self) -> bool:
        return self.scheduler.has_requests() or bool(self._batches)

    # ------------------------------------------------------------------ the step

    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """One pass: schedule, forward, sample, update. Returns the outputs and whether
        any token was computed."""
        if self._batch_runner is not None:
            return self._step_with_batch_queue(self._batch_runner)
        if not self.scheduler.has_requests():
            return [], False
        self.timer.step_started()
        scheduler_output = self.scheduler.schedule()
        self.timer.scheduled(scheduler_output.scheduled_new_reqs)
        model_output = self._execute_and_sample(scheduler_output)
        self.timer.forward_finished()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.timer.attach_queue_times(outputs)
        if not scheduler_output.total_num_scheduled_tokens and not outputs:
            # Nothing could run: the requests left wait for their grammars. Wait for one
            # to compile rather than spin (new input is looked at again within 10 ms).
            self.scheduler.wait_for_grammars(timeout=0.01)
        step_time, forward_time = self.timer.step_finished()
        if self._observe_steps:  # built only for them: every call counts at batch 1
            self._notify_step(scheduler_output, step_time, forward_time)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def _step_with_batch_queue(
        self, runner: RunsBatchesConcurrently
    ) -> tuple[list[EngineCoreOutput], bool]:
        """One turn with several batches in flight: schedule and submit a batch while the
        queue has room (the scheduler leaves out requests in flight), and return at once
        if it still has; otherwise wait for the oldest batch and close its pass. The
        bitmask of a batch is built before it is submitted: its requests' grammars cannot
        move while it is in flight."""
        batches = self._batches
        if not batches and not self.scheduler.has_requests():
            return [], False
        self.timer.step_started()
        scheduler_output = None
        if len(batches) < self.max_concurrent_batches:
            scheduler_output = self.scheduler.schedule()
            self.timer.scheduled(scheduler_output.scheduled_new_reqs)
            submit = (
                scheduler_output.total_num_scheduled_tokens
                or scheduler_output.finished_req_ids
                or scheduler_output.preempted_req_ids
            )
            if submit:  # (the runners also learn of finished and preempted rows)
                grammar_output = None
                constrained = self.scheduler.constrained_sampling(scheduler_output)
                if constrained:
                    with self.timer.building_bitmask():
                        grammar_output = self.structured_output.grammar_output(
                            constrained, scheduler_output.scheduled_spec_decode_tokens
                        )
                self.scheduler.mark_in_flight(scheduler_output)
                future = runner.submit_batch(scheduler_output, grammar_output)
                batches.append((scheduler_output, future))
                if (
                    scheduler_output.total_num_scheduled_tokens
                    and len(batches) < self.max_concurrent_batches
                ):
                    self.timer.step_finished()
                    return [], True
        if not batches:
            # Nothing could run: close the empty pass (outputs of requests whose grammar
            # failed) and wait a little for a grammar to compile rather than spin.
            assert scheduler_output is not None
            outputs = self.scheduler.update_from_output(
                scheduler_output, ModelRunnerOutput(sampled_token_ids={})
            )
            self.scheduler.wait_for_grammars(timeout=0.01)
            self.timer.step_finished()
            return outputs, False
        oldest, oldest_future = batches.popleft()
        self.timer.awaiting_batch()
        model_output = oldest_future.result()
        self.timer.forward_finished()
        if model_output.stage_busy_seconds:
            self.timer.stage_busy_seconds = model_output.stage_busy_seconds
        self.scheduler.mark_returned(oldest)
        outputs = self.scheduler.update_from_output(oldest, model_output)
        self.timer.attach_queue_times(outputs)
        step_time, forward_time = self.timer.step_finished()
        if self._observe_steps:
            self._notify_step(oldest, step_time, forward_time)
        return outputs, oldest.total_num_scheduled_tokens > 0

    def _execute_and_sample(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The forward pass, and meanwhile the grammar bitmask of the constrained requests
        that sample this step, built on the CPU (where the executor runs the pass
        elsewhere); then sampling under it."""
        future = self.executor.execute_model(scheduler_output, non_block=True)
        grammar_output = None
        constrained = self.scheduler.constrained_sampling(scheduler_output)
        if constrained:
            with self.timer.building_bitmask():
                grammar_output = self.structured_output.grammar_output(
                    constrained, scheduler_output.scheduled_spec_decode_tokens
                )
        model_output = future.result() if hasattr(future, "result") else future
        self.timer.forward_returned()
        if model_output is None:
            model_output = self.executor.sample_tokens(grammar_output)
        if self.speculation is not None:
            self.speculation.received(model_output)
        return model_output

    def _notify_step(
        self, scheduler_output: SchedulerOutput, step_time: float, forward_time: float
    ) -> None:
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
