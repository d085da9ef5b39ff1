"""The scheduler as a state machine: schedule() opens a step, update_from_output() closes it.

These tests step it with the real paged allocator and real policies, and play the model
runner's part by sampling a fixed token for every request that reaches the end of its
known tokens.
"""

from __future__ import annotations

import zlib

import pytest

from plugserve.datatypes import ModelRunnerOutput, Request, RequestStatus
from plugserve.engine.scheduler import Scheduler
from plugserve.plugins import get_registry
from plugserve.sampling_params import SamplingParams

EOS = 2
TOKEN = 7  # what the stand-in runner samples


def make_scheduler(
    *,
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    budget=64,
    max_model_len=256,
    policy="fcfs",
    prefix_caching=True,
    max_concurrent_batches=1,
) -> Scheduler:
    registry = get_registry()
    return Scheduler(
        policy=registry.build("scheduler", policy),
        kv_allocator=registry.build(
            "kv_allocator",
            "paged",
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=prefix_caching,
        ),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        max_concurrent_batches=max_concurrent_batches,
    )


def make_request(rid: str, prompt_len: int, *, priority=0, arrival=0.0, **params) -> Request:
    params.setdefault("max_tokens", 4)
    # Deterministic and distinct per request id: hash() of a str changes with every
    # process, and two ids whose prompts began alike would share prefix-cached blocks.
    prompt = [100 + zlib.crc32(f"{rid}:{i}".encode()) % 10_000 for i in range(prompt_len)]
    return Request(
        rid, prompt, SamplingParams(**params), EOS, arrival_time=arrival, priority=priority
    )


def run_step(scheduler: Scheduler, token: int = TOKEN):
    """One step: schedule, then sample `token` for every request that completed its known tokens."""
    out = scheduler.schedule()
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[rid]
        if request.num_computed_tokens + n == request.num_tokens:
            sampled[rid] = [token]
    return out, scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))


def assert_pool_is_whole(scheduler: Scheduler) -> None:
    stats = scheduler.kv.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert not scheduler.requests and not scheduler.running


def test_decodes_and_prefills_share_one_token_budget():
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(make_request("a", 6))
    run_step(scheduler)  # a: prefill 6, samples
    scheduler.add_request(make_request("b", 40))
    out, _ = run_step(scheduler)
    # a decodes one token; b gets what is left of the budget as a prefill chunk.
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    assert out.total_num_scheduled_tokens == 16
    assert scheduler.requests["b"].num_computed_tokens == 15
    assert scheduler.requests["b"].num_output_tokens == 0  # a partial prefill samples nothing


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        scheduler.add_request(make_request(rid, 4))
    out, _ = run_step(scheduler)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert scheduler.num_waiting == 1


def test_finish_reasons():
    scheduler = make_scheduler(max_model_len=12)
    scheduler.add_request(make_request("len", 4, max_tokens=3))
    scheduler.add_request(make_request("model_len", 10, max_tokens=100))
    scheduler.add_request(make_request("stop_id", 4, stop_token_ids=[TOKEN]))
    finished = {}
    while scheduler.has_requests():
        _, outputs = run_step(scheduler)
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert finished["len"].finish_reason == "length"
    assert finished["model_len"].finish_reason == "length"
    assert finished["stop_id"].finish_reason == "stop"
    assert finished["stop_id"].stop_reason == TOKEN
    assert_pool_is_whole(scheduler)


def test_eos_stops_unless_ignored_and_min_tokens_defers_it():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", 4, max_tokens=5))
    scheduler.add_request(make_request("ignore", 4, max_tokens=5, ignore_eos=True))
    scheduler.add_request(make_request("min", 4, max_tokens=5, min_tokens=3))
    outputs_by_id: dict[str, list] = {}
    while scheduler.has_requests():
        _, outputs = run_step(scheduler, token=EOS)
        for o in outputs:
            outputs_by_id.setdefault(o.request_id, []).append(o)
    assert [o.finish_reason for o in outputs_by_id["eos"]] == ["stop"]
    assert outputs_by_id["ignore"][-1].finish_reason == "length"
    assert len(outputs_by_id["ignore"]) == 5
    assert len(outputs_by_id["min"]) == 3 and outputs_by_id["min"][-1].finish_reason == "stop"


def test_kv_shortage_preempts_the_latest_admitted_under_fcfs():
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fill 4, decoding needs more.
    scheduler = make_scheduler(num_blocks=6, block_size=4, prefix_caching=False)
    scheduler.add_request(make_request("first", 8, max_tokens=8, arrival=1.0))
    scheduler.add_request(make_request("second", 8, max_tokens=8, arrival=2.0))
    preempted = []
    while scheduler.has_requests():
        out, _ = run_step(scheduler)
        preempted.extend(out.preempted_req_ids)
    assert "second" in preempted and "first" not in preempted
    assert scheduler.num_preemptions >= 1
    assert_pool_is_whole(scheduler)


def test_priority_policy_admits_and_preempts_by_priority():
    scheduler = make_scheduler(num_blocks=6, block_size=4, policy="priority", prefix_caching=False)
    scheduler.add_request(make_request("low", 8, max_tokens=8, priority=5, arrival=1.0))
    scheduler.add_request(make_request("high", 8, max_tokens=8, priority=0, arrival=2.0))
    out, _ = run_step(scheduler)
    assert list(out.num_scheduled_tokens) == ["high", "low"]
    preempted, finish_order = [], []
    while scheduler.has_requests():
        out, outputs = run_step(scheduler)
        preempted.extend(out.preempted_req_ids)
        finish_order += [o.request_id for o in outputs if o.finished]
    assert preempted and set(preempted) == {"low"}
    assert finish_order == ["high", "low"]


def test_a_preempted_request_resumes_with_its_output_tokens():
    scheduler = make_scheduler(num_blocks=6, block_size=4, prefix_caching=False)
    scheduler.add_request(make_request("first", 8, max_tokens=8, arrival=1.0))
    scheduler.add_request(make_request("second", 8, max_tokens=8, arrival=2.0))
    resumed = None
    while scheduler.has_requests() and resumed is None:
        out, _ = run_step(scheduler)
        resumed = next((n for n in out.scheduled_new_reqs if n.output_token_ids), None)
    assert resumed is not None and resumed.req_id == "second"
    assert resumed.output_token_ids == [TOKEN] * len(resumed.output_token_ids)
    assert resumed.num_computed_tokens == 0  # recompute from scratch


def test_abort_frees_waiting_and_running_requests():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("running", 4, max_tokens=50))
    scheduler.add_request(make_request("waiting", 4, max_tokens=50))
    run_step(scheduler)
    aborted = scheduler.finish_requests(
        ["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED
    )
    assert {r.request_id for r in aborted} == {"running", "waiting"}
    assert_pool_is_whole(scheduler)
    out, _ = run_step(scheduler)
    assert out.finished_req_ids == {"running", "waiting"}  # the runner drops their rows


def test_stats_count_generated_tokens_and_finished_requests_by_reason():
    scheduler = make_scheduler(max_num_seqs=2)
    scheduler.add_request(make_request("length", 4, max_tokens=3))
    scheduler.add_request(make_request("stop", 4, max_tokens=9, stop_token_ids=[TOKEN]))
    scheduler.add_request(make_request("aborted", 4, max_tokens=50))
    for _ in range(3):
        run_step(scheduler)  # length: 3 tokens, stop: 1 token; aborted is admitted at step 2
    aborted = scheduler.requests["aborted"]
    assert aborted.num_output_tokens == 2
    scheduler.finish_requests(["aborted"], RequestStatus.FINISHED_ABORTED)
    run_step(scheduler)  # nothing left: no token and no finish is counted twice
    stats = scheduler.stats()
    assert stats.num_generated_tokens == 3 + 1 + 2
    assert stats.num_finished == {"length": 1, "stop": 1, "abort": 1}
    assert_pool_is_whole(scheduler)


def test_prefix_cache_hit_skips_computed_tokens():
    scheduler = make_scheduler(block_size=4)
    first = make_request("a", 10)
    scheduler.add_request(first)
    while scheduler.has_requests():
        run_step(scheduler)
    again = Request("b", first.prompt_token_ids, SamplingParams(max_tokens=2), EOS)
    scheduler.add_request(again)
    out, _ = run_step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8  # two full blocks hit
    assert out.num_scheduled_tokens["b"] == 2
    assert again.num_cached_tokens == 8


def test_duplicate_request_id_is_refused():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", 4))


def test_a_request_the_policy_refuses_leaves_no_trace():
    """A policy may raise in add(); the scheduler must not keep the request (an engine
    that still 'has requests' would spin forever on nothing to schedule)."""
    scheduler = make_scheduler()

    def refuse(request: Request) -> None:
        raise ValueError("refused")

    scheduler.policy.add = refuse
    with pytest.raises(ValueError, match="refused"):
        scheduler.add_request(make_request("a", 5))
    assert not scheduler.has_requests()
    assert "a" not in scheduler.requests


def sampled_for(scheduler: Scheduler, out) -> ModelRunnerOutput:
    """The stand-in runner's output for batch `out`, computed when it was scheduled."""
    return ModelRunnerOutput(
        sampled_token_ids={
            rid: [TOKEN]
            for rid, n in out.num_scheduled_tokens.items()
            if scheduler.requests[rid].num_computed_tokens + n == scheduler.requests[rid].num_tokens
        }
    )


def test_with_two_batches_in_flight_a_request_in_one_is_never_scheduled_again():
    """Pipeline stages: a batch is scheduled while the one before is still in flight.
    The live requests split over the two batches (each takes its share, half, rounded
    up); a request waits for its batch to return before it is scheduled again, and is
    never chosen to give way while in flight."""
    scheduler = make_scheduler(max_concurrent_batches=2)
    for rid in "abcd":
        scheduler.add_request(make_request(rid, 5, max_tokens=3))
    first = scheduler.schedule()
    scheduler.mark_in_flight(first)
    assert sorted(first.num_scheduled_tokens) == ["a", "b"]
    first_output = sampled_for(scheduler, first)
    second = scheduler.schedule()
    scheduler.mark_in_flight(second)
    assert sorted(second.num_scheduled_tokens) == ["c", "d"]
    second_output = sampled_for(scheduler, second)
    # Both batches in flight: nothing left to schedule.
    assert scheduler.schedule().num_scheduled_tokens == {}
    scheduler.mark_returned(first)
    outputs = scheduler.update_from_output(first, first_output)
    assert {o.request_id: o.new_token_ids for o in outputs} == {"a": [TOKEN], "b": [TOKEN]}
    third = scheduler.schedule()
    assert sorted(third.num_scheduled_tokens) == ["a", "b"]  # c and d are still out
    scheduler.mark_in_flight(third)
    scheduler.mark_returned(second)
    scheduler.update_from_output(second, second_output)
    assert sorted(scheduler.schedule().num_scheduled_tokens) == ["c", "d"]


def test_a_request_in_flight_is_not_preempted_for_blocks():
    """With the pool dry, a request that needs a block may preempt only requests that are
    not in flight: here none but itself, so it gives way, and the one in flight keeps
    its blocks."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_concurrent_batches=2)
    scheduler.add_request(make_request("a", 8, max_tokens=8))  # two blocks
    scheduler.add_request(make_request("b", 4, max_tokens=8))  # one block, then more
    first = scheduler.schedule()
    assert sorted(first.num_scheduled_tokens) == ["a"]
    scheduler.mark_in_flight(first)  # and it stays out
    b = scheduler.requests["b"]
    while b.num_preemptions == 0:
        assert b.num_output_tokens <= 5, "b's 9th token needs a third block of the four"
        out = scheduler.schedule()
        assert list(out.num_scheduled_tokens) in (["b"], [])
        scheduler.mark_in_flight(out)
        scheduler.mark_returned(out)
        scheduler.update_from_output(out, sampled_for(scheduler, out))
    assert b.status == RequestStatus.PREEMPTED
    a = scheduler.requests["a"]
    assert a.status == RequestStatus.RUNNING and a.num_preemptions == 0
    assert len(scheduler.kv.block_ids("a")) == 2


def test_a_spent_thinking_budget_completes_the_end_marker_the_model_began():
    """Reasoning tokens are counted; once the budget is spent the marker's remaining ids
    are constrained one per step (the model had already written its first id), and the
    request is constrained no more once the marker is out."""
    from plugserve.sampling_params import ReasoningParams

    marker = [51, 52, 53]
    scheduler = make_scheduler()
    request = make_request(
        "r", 4, max_tokens=10, reasoning=ReasoningParams(end_token_ids=marker, budget=3)
    )
    scheduler.add_request(request)
    constrained_steps = []
    for token in [9, 9, 51, 52, 53, 9]:  # the stand-in runner samples what was forced
        out = scheduler.schedule()
        forced = scheduler.constrained_sampling(out)
        constrained_steps.append([r.forced_token_ids[0] for r in forced])
        sampled = {"r": [token]}
        (output,) = scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    assert constrained_steps == [[], [], [], [52], [53], []]
    assert output.num_reasoning_tokens == 5 and not request.in_reasoning


def test_a_text_end_marker_ends_the_reasoning_however_its_tokens_spell_it(smollm2_path):
    """Where the end marker is text (no token of its own), the engine finds it in the
    output's text, as the reasoning parser does: spelled with other tokens than its
    usual ones it still ends the reasoning at the token that completes it."""
    from plugserve.config import load_config
    from plugserve.engine.structured_output import StructuredOutputManager
    from plugserve.sampling_params import ReasoningParams

    manager = StructuredOutputManager(load_config(None, {"model": str(smollm2_path)}))
    tokenizer = manager.tokenizer()
    usual = tokenizer.encode("</think>", add_special_tokens=False)
    spelled = [tokenizer.convert_tokens_to_ids(piece) for piece in ("<", "/", "think", ">")]
    assert spelled != usual and tokenizer.decode(spelled) == "</think>"
    scheduler = make_scheduler()
    scheduler.structured_output = manager
    reasoning = ReasoningParams(end_token_ids=usual, end_text="</think>")
    request = make_request("r", 4, max_tokens=10, reasoning=reasoning)
    scheduler.add_request(request)
    ended_after = []
    for token in [9, *spelled, 9]:
        run_step(scheduler, token)
        ended_after.append(not request.in_reasoning)
    assert ended_after == [False, False, False, False, True, True]
    assert request.num_reasoning_tokens == 5
    manager.shutdown()
