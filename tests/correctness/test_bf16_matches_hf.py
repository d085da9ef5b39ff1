"""bfloat16 (what the benchmarks serve) against Hugging Face in bfloat16, within a tolerance.

bf16 logits are coarse (one unit in the last place is 0.0625-0.125 at this model's logit
sizes) and both stacks round differently along the way (packed oneDNN matmuls, the fused
prefill MLP, the paged attention kernel), so exact greedy equality is not expected: ties
and near-ties break differently. The tolerance, per prompt:

- while the two continuations agree, the chosen token's probability differs by at most
  0.1 (measured: at most 0.07; a logprob bound would be too loose for likely tokens and
  too strict for unlikely ones, where one bf16 step of a logit moves it by 0.25);
- where they first differ, Hugging Face scores both choices within 0.3 nats of each other
  (a near-tie broken the other way, not a different prediction).

fp32 stays exact: tests/correctness/test_greedy_matches_hf.py.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from plugserve import LLM, SamplingParams
from plugserve.worker import cpu_linear

NEW_TOKENS = 32
PROBABILITY_TOLERANCE = 0.1
NEAR_TIE = 0.3


@pytest.fixture(scope="module")
def hf_bf16(smollm2_path, mixed_prompts) -> list[tuple[list[int], torch.Tensor]]:
    """HF greedy tokens and the log-softmax of every step's logits, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16)
    results = []
    with torch.inference_mode():
        for prompt in mixed_prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=model.config.eos_token_id,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.scores])
            results.append((tokens, logprobs))
    del model
    gc.collect()
    return results


def test_bf16_greedy_tokens_and_logprobs_match_hf_bf16(mixed_prompts, hf_bf16) -> None:
    llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16", kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in mixed_prompts], params)
    agreed = 0
    for (hf_tokens, hf_logprobs), result in zip(hf_bf16, outputs, strict=True):
        ours = result.outputs[0]
        assert len(ours.token_ids) == NEW_TOKENS
        for i, (theirs, mine) in enumerate(zip(hf_tokens, ours.token_ids, strict=True)):
            if theirs != mine:
                gap = (hf_logprobs[i, theirs] - hf_logprobs[i, mine]).item()
                assert gap <= NEAR_TIE, f"step {i}: HF prefers {theirs} over {mine} by {gap:.3f}"
                break
            agreed += 1
            mine_probability = math.exp(ours.logprobs[i][mine].logprob)
            theirs_probability = hf_logprobs[i, theirs].exp().item()
            assert abs(mine_probability - theirs_probability) <= PROBABILITY_TOLERANCE, f"step {i}"
    # Most of the continuation is compared, not only the first tokens before a tie.
    assert agreed >= len(mixed_prompts) * NEW_TOKENS // 4


@pytest.mark.skipif(
    cpu_linear.own_kernel_unavailable_reason() is not None,
    reason=f"exponent-coded weights need cpu_gemm.cpp: {cpu_linear.own_kernel_unavailable_reason()}",
)
def test_coded_weights_give_batch_one_decoding_the_same_tokens_and_logprobs(
    mixed_prompts, monkeypatch
) -> None:
    """One request at a time every decode step is a one-row step, the steps that read the
    exponent-coded copies: lossless, summed in the same order, so equal to the last bit."""
    # cpu_gemm.cpp also where production would pick oneDNN (AMX CPUs), which has no coded copies.
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, "own")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    results = []
    for coded in (False, True):
        llm = LLM(
            model="smollm2-135m-instruct",
            dtype="bfloat16",
            kv_cache_memory="64MiB",
            cpu_coded_weights=coded,
        )
        head = llm.engine.executor.runner.model._packed_head
        assert (head.coded is not None) == coded
        results.append(
            [llm.generate([{"prompt_token_ids": p}], params)[0] for p in mixed_prompts[:4]]
        )
        del llm
        gc.collect()
    for plain, coded in zip(*results, strict=True):
        assert coded.outputs[0].token_ids == plain.outputs[0].token_ids
        assert coded.outputs[0].logprobs == plain.outputs[0].logprobs
