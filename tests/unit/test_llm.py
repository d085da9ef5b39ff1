"""The offline API, as a vLLM user would call it, on the real embedded model."""

from __future__ import annotations

import itertools
import math
import types

import pytest

from plugserve import LLM, SamplingParams, hookimpl
from plugserve.plugins import PluginRegistry, set_registry

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def llm():
    # fp32, pinned: engine.dtype auto would serve bf16 on a CPU with native bf16.
    llm = LLM(
        model="smollm2-135m-instruct", dtype="float32", kv_cache_memory="64MiB", max_num_seqs=16
    )
    yield llm
    del llm


def assert_every_block_back_in_the_pool(llm: LLM) -> None:
    stats = llm.engine.scheduler.kv.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert not llm.engine.scheduler.requests


def test_the_engine_computes_in_the_dtype_asked_for(llm):
    assert llm.engine.kv_cache_info.dtype == "float32"


def test_generate_returns_one_output_per_prompt_in_order(llm):
    params = SamplingParams(temperature=0, max_tokens=12)
    outputs = llm.generate(
        [*PROMPTS, {"prompt_token_ids": llm.tokenizer.encode(PROMPTS[0])}], params
    )
    assert [o.prompt for o in outputs[:3]] == PROMPTS
    assert outputs[3].prompt_token_ids == outputs[0].prompt_token_ids
    assert outputs[3].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    for out in outputs:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason in ("stop", "length")
        assert 0 < len(completion.token_ids) <= 12
        assert completion.text == llm.tokenizer.decode(
            completion.token_ids, skip_special_tokens=True
        )
    assert "Paris" in outputs[0].outputs[0].text
    assert_every_block_back_in_the_pool(llm)


def test_chat_applies_the_template(llm):
    [out] = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=30),
    )
    assert out.prompt.rstrip().endswith("<|im_start|>assistant")
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its turn with EOS
    assert "<|im_end|>" not in out.outputs[0].text


def test_seeded_sampling_is_reproducible_across_runs_and_batch_mates(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[2], seeded)[0].outputs[0].token_ids
    again = llm.generate(PROMPTS[2], seeded)[0].outputs[0].token_ids
    mates = [
        SamplingParams(temperature=0.8, max_tokens=30),
        SamplingParams(temperature=1.2, seed=7, max_tokens=5),
    ]
    in_batch = (
        llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [*mates, seeded])[2].outputs[0].token_ids
    )
    assert alone == again == in_batch
    other_seed = SamplingParams(
        temperature=1.0, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True
    )
    assert llm.generate(PROMPTS[2], other_seed)[0].outputs[0].token_ids != alone


def _top(entry: dict, n: int) -> dict[int, float]:
    """The top-n alternatives of one logprobs entry, token id -> logprob."""
    return {token: lp.logprob for token, lp in entry.items() if lp.rank <= n}


def test_n_greedy_completions_are_copies_of_the_single_one(llm):
    greedy = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    single, out = llm.generate(
        [PROMPTS[2], PROMPTS[2]], [SamplingParams(**greedy), SamplingParams(n=3, **greedy)]
    )
    assert [c.index for c in out.outputs] == [0, 1, 2]
    expected = single.outputs[0]
    assert len(expected.token_ids) == 16
    for completion in out.outputs:
        assert completion.token_ids == expected.token_ids
        assert completion.text == expected.text
        assert completion.finish_reason == "length"
    assert_every_block_back_in_the_pool(llm)


def test_n_sampled_completions_differ_and_each_continues_the_prompt(llm):
    num_tokens, top_n = 16, 5
    params = SamplingParams(
        n=3, temperature=1.0, max_tokens=num_tokens, ignore_eos=True, logprobs=top_n
    )
    # With a request of one token for the same prompt, whose alternatives the samples'
    # first ones must equal.
    one_token = SamplingParams(temperature=1.0, max_tokens=1, logprobs=top_n)
    out, one = llm.generate([PROMPTS[2], PROMPTS[2]], [params, one_token])
    completions = out.outputs
    assert [c.index for c in completions] == [0, 1, 2]
    # Two independent samples are equal with probability sum_s P(s)^2 = E[P(s)], the mean
    # probability of a sample. On this prompt 16 tokens at temperature 1.0 have cumulative
    # logprobs of -16 to -62 (measured over 12 samples), so P(s) < 1e-7: some pair of the
    # three equal has odds below 3 in ten million. Equal choices mean shared randomness.
    token_ids = [tuple(c.token_ids) for c in completions]
    assert len(set(token_ids)) == 3, token_ids

    vocab_size = len(llm.tokenizer)
    for completion in completions:
        assert len(completion.token_ids) == num_tokens
        assert completion.finish_reason == "length"
        assert all(0 <= t < vocab_size for t in completion.token_ids)
        assert completion.text == llm.tokenizer.decode(
            completion.token_ids, skip_special_tokens=True
        )
        assert len(completion.logprobs) == num_tokens
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            sampled = entry[token]
            assert -math.inf < sampled.logprob <= 0 and sampled.rank >= 1
            top = _top(entry, top_n)
            assert len(top) == top_n
            # The sampled token's rank agrees with the alternatives' logprobs.
            assert sum(lp > sampled.logprob for lp in top.values()) == min(sampled.rank - 1, top_n)
        assert completion.cumulative_logprob == pytest.approx(
            sum(
                e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True)
            )
        )
    # Each continues this prompt: its first alternatives are those a single request gets,
    # and where two samples share their first k tokens the model saw the same text, so
    # the alternatives it offered at positions 0..k agree.
    first = _top(one.outputs[0].logprobs[0], top_n)
    for completion in completions:
        assert _top(completion.logprobs[0], top_n) == pytest.approx(first, abs=1e-4)
    for a, b in itertools.combinations(completions, 2):
        shared = next(
            (k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
            num_tokens,
        )
        for k in range(min(shared + 1, num_tokens)):
            top_a, top_b = _top(a.logprobs[k], top_n), _top(b.logprobs[k], top_n)
            assert top_a == pytest.approx(top_b, abs=1e-4), k
    assert_every_block_back_in_the_pool(llm)


def test_logprobs_with_top_alternatives(llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
    [out] = llm.generate(PROMPTS[0], params)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1  # greedy picks the most likely
        assert len(entry) == 3  # the sampled token is also the top-1
        assert all(lp.logprob <= 0 for lp in entry.values())
        assert sorted(entry.values(), key=lambda lp: lp.rank)[0].logprob == entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True))
    )


def test_stop_string_ends_generation_and_frees_blocks(llm):
    free_run = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    text = free_run[0].outputs[0].text
    stop = text.strip().split()[1]  # a word the model is going to write
    [out] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[: text.index(stop)]
    assert_every_block_back_in_the_pool(llm)


def test_stop_token_ids_and_max_tokens(llm):
    free_run = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )
    ids = free_run[0].outputs[0].token_ids
    [out] = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[3]])
    )
    assert out.outputs[0].token_ids == ids[: ids.index(ids[3]) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == ids[3]


def test_a_prompt_too_long_is_refused_and_others_are_unaffected(llm):
    too_long = {"prompt_token_ids": [1] * llm.engine.max_model_len}
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([PROMPTS[0], too_long], SamplingParams(max_tokens=4))
    assert_every_block_back_in_the_pool(llm)
    assert llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))[0].finished


def test_bfloat16_on_cpu_is_chosen_explicitly():
    llm = LLM(dtype="bfloat16", kv_cache_memory="16MiB", max_num_seqs=4)
    assert llm.engine.kv_cache_info.dtype == "bfloat16"
    # A prompt whose greedy answer wins every step by over 1.7 nats in fp32: bf16 rounding
    # moves logprobs by ~0.02 on average and 0.2 at worst, and breaks near-ties either way
    # ("What is the capital of France?" opens on one: 0.08 nats in fp32).
    [out] = llm.chat(
        [{"role": "user", "content": "Complete the sentence: The capital of France is"}],
        SamplingParams(temperature=0, max_tokens=12),
    )
    assert "Paris" in out.outputs[0].text


def test_observer_hooks_see_steps_and_finished_requests():
    finished, steps = [], []
    observer = types.SimpleNamespace(
        request_finished=hookimpl(
            lambda request_id, finish_reason, num_prompt_tokens, num_output_tokens: finished.append(
                (request_id, finish_reason, num_output_tokens)
            )
        ),
        engine_step_finished=hookimpl(lambda stats: steps.append(stats)),
    )
    registry = PluginRegistry()
    registry.register(observer, name="observer", distribution="acme-observer")
    previous = set_registry(registry)
    try:
        llm = LLM(dtype="float32", kv_cache_memory="16MiB", max_num_seqs=4)
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        set_registry(previous)
    assert sorted(finished) == [("0", "length", 6), ("1", "length", 6)]
    assert len(steps) == 6
    assert steps[0].num_scheduled_tokens == sum(len(llm.tokenizer.encode(p)) for p in PROMPTS[:2])
    assert all(0 < s.forward_time <= s.step_time for s in steps)


def test_max_model_len_is_capped_at_what_the_kv_pool_holds():
    # 4 blocks of 16 tokens: a longer request could never be scheduled.
    llm = LLM(dtype="float32", num_kv_blocks=4, max_num_seqs=2, max_num_batched_tokens=64)
    assert llm.engine.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate({"prompt_token_ids": [100] * 70}, SamplingParams(max_tokens=4))
    [out] = llm.generate({"prompt_token_ids": [100] * 40}, SamplingParams(max_tokens=100))
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64


def test_sampling_metadata_is_rebuilt_only_when_the_batch_changes(llm, monkeypatch):
    batch = llm.engine.executor.runner.input_batch
    builds: list[int] = []
    build = batch.sampling_metadata
    monkeypatch.setattr(
        batch, "sampling_metadata", lambda *a: builds.append(len(a[0])) or build(*a)
    )
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(PROMPTS[0], greedy)
    assert builds == [1]  # once for the prefill, reused by the seven decode steps
    builds.clear()
    llm.generate(PROMPTS[:2], [greedy, short])
    assert builds == [2, 1]  # both rows, then the one left when the short one ends
    builds.clear()
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, presence_penalty=0.5, seed=1))
    assert builds == [1, 1, 1, 1]  # penalties read the tokens so far: every step
    builds.clear()
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, bad_words_token_ids=[[5, 6]]))
    assert builds == [1, 1, 1]  # so do bad words
    builds.clear()
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, logit_bias={5: -1.0}))
    assert builds == [1]  # a logit bias does not


def test_a_request_taking_a_finished_ones_row_samples_with_its_own_parameters(llm):
    """One row at a time: the seeded request joins in the very step the greedy one leaves,
    into the same row, so only the batch's version tells the reused metadata is stale."""
    seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], seeded)[0].outputs[0].token_ids
    one_row = LLM(
        model="smollm2-135m-instruct", dtype="float32", kv_cache_memory="16MiB", max_num_seqs=1
    )
    after = one_row.generate([PROMPTS[0], PROMPTS[1]], [greedy, seeded])[1].outputs[0].token_ids
    as_greedy = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12))
    assert after == alone
    assert alone != as_greedy[0].outputs[0].token_ids


def test_logit_bias_allowed_token_ids_and_bad_words_reach_the_sampler(llm):
    def first_token(**params) -> int:
        params = SamplingParams(temperature=0, max_tokens=1, **params)
        return llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids[0]

    greedy = first_token()
    assert first_token(logit_bias={greedy: -100.0}) != greedy
    assert first_token(allowed_token_ids=[11, 12]) in (11, 12)
    assert first_token(bad_words_token_ids=[[greedy]]) != greedy
    # A small bias on another token leaves the pick as it was.
    assert first_token(logit_bias={greedy + 1: 1.0}) == greedy
