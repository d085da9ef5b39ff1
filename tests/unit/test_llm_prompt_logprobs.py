"""prompt_logprobs through the offline API on SmolLM2: for each prompt token, its logprob
given the tokens before it (with its rank and the top-N), None for the first.

The engine runs with a token budget of 8, so every prompt here is prefilled in chunks and
the logprobs of one prompt come from several steps. A prompt made of a prefix and the
greedy continuation the model generated from it must get, at the continuation's
positions, the very logprobs that generation reported (rank 1: they were the argmax). A
request asking for prompt logprobs takes no prefix-cache hit (its prompt's logits are all
needed), as in vLLM.
"""

from __future__ import annotations

import pytest

from plugserve import LLM, SamplingParams

PREFIX = "The capital of France is"
TOP_N = 3


@pytest.fixture(scope="module")
def llm():
    llm = LLM(
        model="smollm2-135m-instruct",
        dtype="float32",
        kv_cache_memory="32MiB",
        max_num_seqs=4,
        max_num_batched_tokens=8,
    )
    yield llm
    llm.engine.shutdown()


def test_prompt_logprobs_equal_what_generation_reported(llm) -> None:
    prefix = llm.tokenizer.encode(PREFIX)
    generated = llm.generate(
        {"prompt_token_ids": prefix},
        SamplingParams(temperature=0, max_tokens=6, logprobs=TOP_N, ignore_eos=True),
    )[0].outputs[0]
    prompt = prefix + generated.token_ids
    [out] = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=TOP_N)
    )
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for position, token in enumerate(prompt[1:], 1):
        entry = plp[position]
        assert entry is not None and token in entry and len(entry) <= TOP_N + 1
    for i, token in enumerate(generated.token_ids):
        entry = plp[len(prefix) + i]
        expected = generated.logprobs[i]
        assert entry[token].rank == 1
        assert entry[token].logprob == pytest.approx(expected[token].logprob, abs=1e-3)
        assert sorted(entry) == sorted(expected)  # the same top-N


def test_a_prompt_logprobs_request_takes_no_prefix_cache_hit(llm) -> None:
    # Longer than two KV blocks of 16 tokens: whole blocks are what the cache keeps.
    prompt = llm.tokenizer.encode(
        "Once upon a time, in a small village at the foot of a tall mountain, there lived "
        "an old clockmaker who repaired every clock in the valley and never charged a coin"
    )
    assert len(prompt) > 32
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    first = llm.generate({"prompt_token_ids": prompt}, params)[0]
    # Its blocks are in the prefix cache now; a plain request would hit them.
    assert (
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))[
            0
        ].num_cached_tokens
        > 0
    )
    again = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert again.num_cached_tokens == 0
    assert len(again.prompt_logprobs) == len(prompt)
    for a, b, token in zip(
        first.prompt_logprobs[1:], again.prompt_logprobs[1:], prompt[1:], strict=True
    ):
        assert set(a) == set(b) == {token}  # prompt_logprobs=0: only the prompt's token
        assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)
