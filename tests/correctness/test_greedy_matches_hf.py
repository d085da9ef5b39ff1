"""Greedy generation through the whole plugin stack equals Hugging Face `generate`
token for token (fp32), however the engine is forced to schedule the work."""

from __future__ import annotations

import gc

import pytest

from plugserve import LLM, SamplingParams
from plugserve.messages import EngineCoreRequest

from .conftest import MAX_NEW_TOKENS

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def make_llm(**overrides) -> LLM:
    # A modest KV pool: enough for the eight prompts at once unless a test shrinks it.
    overrides.setdefault("kv_cache_memory", "64MiB")
    overrides.setdefault("max_num_seqs", 16)
    return LLM(model="smollm2-135m-instruct", dtype="float32", **overrides)


def assert_every_block_back_in_the_pool(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    stats = scheduler.kv.stats()
    assert not scheduler.requests and not scheduler.running and scheduler.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


def generate_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture
def release():
    """Each test builds its own engine; free it before the next one loads."""
    held: list[LLM] = []
    yield held.append
    held.clear()
    gc.collect()


def test_all_at_once_matches_hf_and_prefix_cache_hits_in_a_second_round(
    mixed_prompts, hf_greedy, release
):
    llm = make_llm()
    release(llm)
    assert generate_ids(llm, mixed_prompts) == hf_greedy
    assert_every_block_back_in_the_pool(llm)

    hits_before = llm.engine.scheduler.kv.stats().prefix_cache_hits
    assert generate_ids(llm, mixed_prompts) == hf_greedy
    stats = llm.engine.scheduler.kv.stats()
    # Every full block but the one holding a prompt's last token is found again.
    assert stats.prefix_cache_hits - hits_before >= sum(
        (len(p) - 1) // 16 * 16 for p in mixed_prompts
    )
    assert_every_block_back_in_the_pool(llm)


def test_chunked_prefill_matches_hf(mixed_prompts, hf_greedy, release):
    llm = make_llm(max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False)
    release(llm)
    assert generate_ids(llm, mixed_prompts) == hf_greedy
    assert_every_block_back_in_the_pool(llm)


def test_preemption_matches_hf(mixed_prompts, hf_greedy, release):
    # 40 blocks of 16 tokens hold the longest request (432 tokens) but not all eight.
    llm = make_llm(num_kv_blocks=40)
    release(llm)
    assert generate_ids(llm, mixed_prompts) == hf_greedy
    assert llm.engine.scheduler.num_preemptions > 0
    assert_every_block_back_in_the_pool(llm)


# Two requests at a time make the eight run in four rounds; the order they finish in is
# the policy's, at any length, so a quarter of the others' tokens keeps this test from
# costing four full rounds of MAX_NEW_TOKENS (those are checked by the tests above).
PRIORITY_NEW_TOKENS = MAX_NEW_TOKENS // 4


def test_priority_policy_matches_hf_and_serves_higher_priority_first(
    mixed_prompts, hf_greedy, release
):
    llm = make_llm(scheduler="priority", max_num_seqs=2, num_kv_blocks=40)
    release(llm)
    # Greedy: the first tokens of the reference's continuation are the continuation of
    # fewer tokens.
    params = SamplingParams(temperature=0.0, max_tokens=PRIORITY_NEW_TOKENS, ignore_eos=True)
    # Lower value = more urgent; deliberately not the submission order.
    priorities = [5, 3, 7, 0, 6, 1, 4, 2]
    engine = llm.engine
    for i, (prompt, priority) in enumerate(zip(mixed_prompts, priorities, strict=True)):
        engine.add_request(
            EngineCoreRequest(
                request_id=str(i),
                prompt_token_ids=prompt,
                sampling_params=params,
                priority=priority,
            )
        )
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(mixed_prompts))}
    finish_order: list[int] = []
    while engine.has_requests():
        outputs, _ = engine.step()
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish_order.append(priorities[int(out.request_id)])
    expected = [reference[:PRIORITY_NEW_TOKENS] for reference in hf_greedy]
    assert [tokens[str(i)] for i in range(len(mixed_prompts))] == expected
    assert finish_order == sorted(priorities)
    assert_every_block_back_in_the_pool(llm)
