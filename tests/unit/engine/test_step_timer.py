"""The engine's clock (engine/step_timer.py): the counters /metrics serves and what the
engine_step_finished observers see come from the same marks, and each request's queue
time reaches its first output, once. No test reads a duration's size, only where it went."""

from __future__ import annotations

import types
from collections.abc import Sequence

import pytest

from plugserve import LLM, SamplingParams, hookimpl
from plugserve.datatypes import NewRequestData
from plugserve.engine.step_timer import StepTimer
from plugserve.messages import EngineCoreOutput, SchedulerStats
from plugserve.plugins import PluginRegistry, set_registry


def new_request(request_id: str) -> NewRequestData:
    return NewRequestData(
        req_id=request_id,
        prompt_token_ids=[1, 2],
        output_token_ids=[],
        sampling_params=SamplingParams(),
        block_ids=[0],
        num_computed_tokens=0,
    )


def one_step(
    timer: StepTimer, new: Sequence[str] = (), bitmask: bool = False
) -> tuple[float, float]:
    timer.step_started()
    timer.scheduled([new_request(r) for r in new])
    if bitmask:
        with timer.building_bitmask():
            pass
    timer.forward_returned()
    timer.forward_finished()
    return timer.step_finished()


def test_observers_see_the_steps_the_metrics_count() -> None:
    steps = []
    step_log = types.SimpleNamespace(
        engine_step_finished=hookimpl(lambda stats: steps.append(stats))
    )
    registry = PluginRegistry()
    registry.register(step_log, name="step_log", distribution="acme-step-log")
    previous = set_registry(registry)
    try:
        llm = LLM(dtype="float32", kv_cache_memory="16MiB", max_num_seqs=4)
        llm.generate(
            ["The capital of France is", "def fibonacci(n):"],
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        )
    finally:
        set_registry(previous)
    counters = llm.engine.stats()
    assert counters.num_steps == len(steps) == 5
    assert counters.step_seconds == pytest.approx(sum(s.step_time for s in steps))
    assert counters.forward_seconds == pytest.approx(sum(s.forward_time for s in steps))


def test_each_step_is_counted_with_its_forward_pass_inside_it() -> None:
    timer = StepTimer()
    times = [one_step(timer) for _ in range(3)]
    counters = timer.add_counters(SchedulerStats())
    assert counters.num_steps == 3
    assert counters.step_seconds == pytest.approx(sum(step for step, _ in times))
    assert counters.forward_seconds == pytest.approx(sum(forward for _, forward in times))
    assert all(0 <= forward <= step for step, forward in times)
    assert counters.grammar_bitmask_steps == 0 and counters.grammar_forward_wait_seconds == 0


def test_only_steps_that_build_a_bitmask_count_as_grammar_steps() -> None:
    timer = StepTimer()
    one_step(timer, bitmask=True)
    one_step(timer)
    one_step(timer, bitmask=True)
    counters = timer.add_counters(SchedulerStats())
    assert counters.grammar_bitmask_steps == 2
    assert counters.grammar_bitmask_hidden_steps <= 2


def test_output_time_is_step_time_outside_the_forward_pass() -> None:
    timer = StepTimer()
    step, forward = one_step(timer)
    timer.count_output_time(0.5)
    counters = timer.add_counters(SchedulerStats())
    assert counters.step_seconds == pytest.approx(step + 0.5)
    assert counters.forward_seconds == pytest.approx(forward)


def test_a_requests_queue_time_goes_on_its_first_output_only() -> None:
    timer = StepTimer()
    timer.queued("a")
    timer.queued("b")
    one_step(timer, new=["a"])
    first = [EngineCoreOutput(request_id="a", new_token_ids=[5])]
    timer.attach_queue_times(first)
    later = [EngineCoreOutput(request_id="a", new_token_ids=[6])]
    timer.attach_queue_times(later)
    assert first[0].queue_seconds is not None and first[0].queue_seconds >= 0
    assert later[0].queue_seconds is None
    one_step(timer, new=["b"])
    b = [EngineCoreOutput(request_id="b", new_token_ids=[5])]
    timer.attach_queue_times(b)
    assert b[0].queue_seconds is not None


def test_a_preempted_request_coming_back_does_not_queue_again() -> None:
    timer = StepTimer()
    timer.queued("a")
    one_step(timer, new=["a"])
    timer.attach_queue_times([EngineCoreOutput(request_id="a", new_token_ids=[5])])
    one_step(timer, new=["a"])  # resumed after preemption: scheduled as new again
    resumed = [EngineCoreOutput(request_id="a", new_token_ids=[6])]
    timer.attach_queue_times(resumed)
    assert resumed[0].queue_seconds is None


def test_an_aborted_or_never_run_request_leaves_nothing_behind() -> None:
    timer = StepTimer()
    timer.queued("aborted")
    timer.queued("never-ran")
    timer.forget("aborted")
    failed = [EngineCoreOutput(request_id="never-ran", new_token_ids=[], finish_reason="error")]
    timer.attach_queue_times(failed)
    assert failed[0].queue_seconds is None
    one_step(timer, new=["aborted", "never-ran"])
    late = [EngineCoreOutput(request_id=r, new_token_ids=[1]) for r in ("aborted", "never-ran")]
    timer.attach_queue_times(late)
    assert [o.queue_seconds for o in late] == [None, None]
