"""The engine's own clock: what its steps cost, and how long each request queued.

EngineCore.step() marks the phases of a step on a StepTimer and the timer keeps the
counters (/metrics' plugserve_engine_* and plugserve_grammar_*, through SchedulerStats)
and gives each step's times to the engine_step_finished observers, so both report the
same figures.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import msgspec

from plugserve.datatypes import NewRequestData
from plugserve.messages import EngineCoreOutput, SchedulerStats

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


class StepTimer:
    """Counters since the engine started, and the marks of the step in progress:
    `step_started`, `scheduled`, (`building_bitmask`, `forward_returned`),
    `forward_finished`, `step_finished`, in that order."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.step_seconds = 0.0
        self.forward_seconds = 0.0
        self.grammar_bitmask_steps = 0
        self.grammar_bitmask_seconds = 0.0
        self.grammar_forward_wait_seconds = 0.0
        self.grammar_bitmask_hidden_steps = 0
        self.stage_busy_seconds: list[float] = []  # the latest a batch brought back
        self._step_started = 0.0
        self._forward_started = 0.0
        self._forward_time = 0.0
        self._bitmask_done: float | None = None
        # When each request was queued, until first scheduled; then the seconds it waited,
        # until its first output carries them (EngineCoreOutput.queue_seconds).
        self._queued_at: dict[str, float] = {}
        self._queue_seconds: dict[str, float] = {}

    # ------------------------------------------------------------------ requests

    def queued(self, request_id: str) -> None:
        self._queued_at[request_id] = time.monotonic()

    def forget(self, request_id: str) -> None:
        """An aborted request: it will have no output to carry its queue time."""
        self._queued_at.pop(request_id, None)
        self._queue_seconds.pop(request_id, None)

    def attach_queue_times(self, outputs: list[EngineCoreOutput]) -> None:
        """Each request's queue time goes on its first output."""
        if not (self._queue_seconds or self._queued_at):
            return
        for output in outputs:
            queue_seconds = self._queue_seconds.pop(output.request_id, None)
            if queue_seconds is not None:
                output.queue_seconds = queue_seconds
            elif output.finished:  # it never ran (a grammar that failed to compile)
                self._queued_at.pop(output.request_id, None)

    # ------------------------------------------------------------------ a step's marks

    def step_started(self) -> None:
        self._step_started = time.perf_counter()
        self._forward_time = 0.0

    def scheduled(self, new_requests: list[NewRequestData]) -> None:
        """The schedule is made and the forward pass begins; the newly scheduled requests
        stop queueing."""
        self._forward_started = time.perf_counter()
        self._bitmask_done = None
        if self._queued_at:
            now = time.monotonic()
            for new_request in new_requests:
                queued_at = self._queued_at.pop(new_request.req_id, None)
                if queued_at is not None:  # not a preempted request coming back
                    self._queue_seconds[new_request.req_id] = now - queued_at

    @contextlib.contextmanager
    def building_bitmask(self) -> Iterator[None]:
        """Around the grammar bitmask built while the forward pass runs."""
        started = time.perf_counter()
        yield
        self._bitmask_done = time.perf_counter()
        self.grammar_bitmask_steps += 1
        self.grammar_bitmask_seconds += self._bitmask_done - started

    def forward_returned(self) -> None:
        """The executor's result is in: how long it was still awaited after the bitmask."""
        if self._bitmask_done is None:
            return
        waited = time.perf_counter() - self._bitmask_done
        self.grammar_forward_wait_seconds += waited
        # Still waiting for the forward pass after the bitmask: it hid all of it.
        if waited > HIDDEN_WAIT_S:
            self.grammar_bitmask_hidden_steps += 1

    def awaiting_batch(self) -> None:
        """With batches in flight (pipeline stages): the engine now waits for the oldest;
        the wait is the step's forward time."""
        self._forward_started = time.perf_counter()

    def forward_finished(self) -> None:
        """Sampled: the executor's part of the step is over."""
        self._forward_time = time.perf_counter() - self._forward_started

    def step_finished(self) -> tuple[float, float]:
        """Counts the step; returns its step time and forward time, in seconds."""
        step_time = time.perf_counter() - self._step_started
        self.num_steps += 1
        self.step_seconds += step_time
        self.forward_seconds += self._forward_time
        return step_time, self._forward_time

    def count_output_time(self, seconds: float) -> None:
        """Time the caller spent handing a step's outputs on after step() returned (the
        engine process sends them from its busy loop on a CPU): step time, and overhead."""
        self.step_seconds += seconds

    # ------------------------------------------------------------------ reporting

    def add_counters(self, stats: SchedulerStats) -> SchedulerStats:
        stats.num_steps = self.num_steps
        stats.step_seconds = self.step_seconds
        stats.forward_seconds = self.forward_seconds
        stats.grammar_bitmask_steps = self.grammar_bitmask_steps
        stats.grammar_bitmask_seconds = self.grammar_bitmask_seconds
        stats.grammar_forward_wait_seconds = self.grammar_forward_wait_seconds
        stats.grammar_bitmask_hidden_steps = self.grammar_bitmask_hidden_steps
        stats.pipeline_stage_busy_seconds = list(self.stage_busy_seconds)
        return stats
