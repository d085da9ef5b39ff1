"""Pooling requests through the scheduler: the same token budget and chunked prefill as
generation; a request finishes, carrying its pooled output, in the step its last prompt
chunk runs, and its blocks go back then. Under an encoder a prompt is scheduled whole
and never starts from cached blocks."""

from __future__ import annotations

import numpy as np

from plugserve.datatypes import ModelRunnerOutput, PooledTensor, Request
from plugserve.engine.pooling_scheduling import PoolingScheduling
from plugserve.engine.scheduler import Scheduler
from plugserve.plugins import get_registry
from plugserve.pooling_params import PoolingParams
from plugserve.sampling_params import SamplingParams

VECTOR = PooledTensor.from_array(np.ones(4, dtype=np.float32))


def make_scheduler(whole_prompts: bool, budget: int = 8) -> Scheduler:
    registry = get_registry()
    return Scheduler(
        policy=registry.build("scheduler", "fcfs"),
        kv_allocator=registry.build(
            "kv_allocator", "paged", num_blocks=32, block_size=4, enable_prefix_caching=True
        ),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=64,
        pooling=PoolingScheduling(whole_prompts=whole_prompts, reads_every_token=False),
    )


def pooling_request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1), None, pooling_params=PoolingParams())


def step(scheduler: Scheduler):
    """Schedule, and pool every request whose prompt completes in the step."""
    out = scheduler.schedule()
    pooled = {
        rid: VECTOR
        for rid, n in out.num_scheduled_tokens.items()
        if scheduler.requests[rid].num_computed_tokens + n == scheduler.requests[rid].num_tokens
    }
    return out, scheduler.update_from_output(
        out, ModelRunnerOutput(sampled_token_ids={}, pooled=pooled)
    )


def test_a_decoder_prompt_is_chunked_and_finishes_with_its_vector():
    scheduler = make_scheduler(whole_prompts=False)
    scheduler.add_request(pooling_request("a", list(range(100, 120))))  # 20 tokens, budget 8
    chunks, outputs = [], []
    while scheduler.has_requests():
        out, produced = step(scheduler)
        chunks.append(out.num_scheduled_tokens.get("a", 0))
        outputs += produced
    assert chunks[:3] == [8, 8, 4]
    (final,) = outputs
    assert final.finish_reason == "stop" and final.pooled == VECTOR and final.new_token_ids == []
    assert scheduler.kv.stats().num_free_blocks == 32  # every block back
    # Prefix caching stays right: the same prompt again reuses the full blocks, and its
    # last token is computed, so the pooled (last) hidden state exists.
    scheduler.add_request(pooling_request("b", list(range(100, 120))))
    out, produced = step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens == {"b": 4}
    assert [o.pooled for o in produced] == [VECTOR]


def test_an_encoder_prompt_runs_whole_and_waits_for_room():
    scheduler = make_scheduler(whole_prompts=True, budget=10)
    scheduler.add_request(pooling_request("first", list(range(200, 206))))  # 6 tokens
    scheduler.add_request(pooling_request("second", list(range(300, 306))))  # 6 more
    out, produced = step(scheduler)
    assert out.num_scheduled_tokens == {"first": 6}  # "second" is not split to fit
    assert [o.request_id for o in produced] == ["first"]
    out, produced = step(scheduler)
    assert out.num_scheduled_tokens == {"second": 6}
    # An encoder shares no cached prefix: the same prompt again computes every token.
    scheduler.add_request(pooling_request("again", list(range(200, 206))))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"again": 6}
    assert out.scheduled_new_reqs[0].pooling_params == PoolingParams()
