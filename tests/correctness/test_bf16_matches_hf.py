"""bfloat16 (what the benchmarks serve) against Hugging Face in bfloat16, by the criterion
of tests/correctness/agreement.py: first tokens equal, logprobs close at every position up
to the first divergence, and that divergence a near-tie in Hugging Face's own scores.

The prompts run twice: in one batch (batched matmuls, chunked varlen attention) and one
at a time (every decode step a one-row step: exponent-coded weights where the CPU has
them). fp32 stays exact: tests/correctness/test_greedy_matches_hf.py.
"""

from __future__ import annotations

import gc

import pytest
import torch

from correctness.agreement import Reference, assert_agrees, clear_first_tokens
from correctness.conftest import BF16_NEW_TOKENS
from plugserve import LLM, SamplingParams
from plugserve_plugins.cpu_bf16 import cpu_features, kernel_setting, packed_linear
from plugserve_plugins.cpu_bf16.kernel_plan import KernelPlan
from tests.kernel_support import (
    missing_cpu_flags,
    offered_kernels,
    offered_kernels_by_bucket,
    pinned_plan,
    plan_featuring,
    plan_setting,
)

NEW_TOKENS = BF16_NEW_TOKENS
# A plan's or a weight layout's own check: enough decode steps past its prefills (the
# pinned plan's engine answers every prompt of the set with NEW_TOKENS).
PLAN_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def bf16_set(mixed_prompts, hf_greedy_references) -> tuple[list[list[int]], list]:
    """The prompts whose first token Hugging Face's bf16 scores prefer clearly on this
    machine, and their references: a prompt that starts at a near-tie cannot show a
    first-token error. At most two of the set are left out."""
    references = hf_greedy_references(mixed_prompts, NEW_TOKENS, torch.bfloat16)
    clear = clear_first_tokens(references)
    assert sum(clear) >= len(mixed_prompts) - 2, [len(p) for p in mixed_prompts]
    kept = [(p, r) for p, r, ok in zip(mixed_prompts, references, clear, strict=True) if ok]
    return [p for p, _ in kept], [r for _, r in kept]


@pytest.fixture(scope="module")
def bf16_prompts(bf16_set) -> list[list[int]]:
    return bf16_set[0]


@pytest.fixture(scope="module")
def hf_bf16(bf16_set) -> list:
    return bf16_set[1]


@pytest.fixture(scope="module")
def bf16_llm():
    llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16", kv_cache_memory="64MiB")
    yield llm
    del llm
    gc.collect()


@pytest.mark.parametrize("batched", [True, False], ids=["one-batch", "one-at-a-time"])
def test_bf16_greedy_tokens_and_logprobs_match_hf_bf16(
    bf16_llm, bf16_prompts, hf_bf16, batched
) -> None:
    llm = bf16_llm
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in bf16_prompts]
    if batched:
        outputs = llm.generate(requests, params)
    else:
        outputs = [llm.generate([r], params)[0] for r in requests]
    for prompt, reference, result in zip(bf16_prompts, hf_bf16, outputs, strict=True):
        ours = result.outputs[0]
        chosen = [lp[t].logprob for t, lp in zip(ours.token_ids, ours.logprobs, strict=True)]
        assert_agrees(f"{len(prompt)}-token prompt", reference, ours.token_ids, chosen)


@pytest.mark.skipif(
    bool(missing_cpu_flags(cpu_features.OWN_KERNEL_CPU_FLAGS)),
    reason="exponent-coded weights need cpu_gemm.cpp, and the CPU lacks its instructions",
)
def test_coded_weights_give_batch_one_decoding_the_same_tokens_and_logprobs(
    mixed_prompts, monkeypatch
) -> None:
    """One request at a time every decode step is a one-row step, the steps that read the
    exponent-coded copies: lossless, summed in the same order, so equal to the last bit."""
    # cpu_gemm.cpp's one-row stream over the plain or the coded copies, whatever plan this
    # machine would measure.
    params = SamplingParams(
        temperature=0.0, max_tokens=PLAN_NEW_TOKENS, ignore_eos=True, logprobs=3
    )
    results = []
    for coded in (False, True):
        one_row = "own/coded" if coded else "own"
        monkeypatch.setenv(kernel_setting.KERNEL_ENV, f"{one_row},own,own,own,own")
        llm = LLM(
            model="smollm2-135m-instruct",
            dtype="bfloat16",
            kv_cache_memory="64MiB",
            **{"plugins.cpu_bf16": {"coded_weights": coded}},
        )
        head = llm.engine.executor.runner.model.model.embed_tokens.packed_head  # tied
        assert (head.coded is not None) == coded
        results.append(
            [llm.generate([{"prompt_token_ids": p}], params)[0] for p in mixed_prompts[:3]]
        )
        del llm
        gc.collect()
    for plain, coded in zip(*results, strict=True):
        assert coded.outputs[0].token_ids == plain.outputs[0].token_ids
        assert coded.outputs[0].logprobs == plain.outputs[0].logprobs


def _plans_to_try() -> list[KernelPlan]:
    """Each kernel the chooser may offer here, in every bucket it may take (plan_featuring),
    and each one-row kernel at one row alone beside the pinned plan's others: the fused
    decoder runs one cpu_gemm mode for all its rows, so a one-row choice unlike the rest is
    a case of its own."""
    pinned = pinned_plan()
    plans = [plan_featuring(kernel) for kernel in offered_kernels()]
    plans += [
        KernelPlan((kernel, *pinned.by_bucket[1:])) for kernel in offered_kernels_by_bucket()[0]
    ]
    return list(dict.fromkeys(plans))


@pytest.mark.parametrize("plan", _plans_to_try(), ids=plan_setting)
def test_every_plan_the_chooser_can_make_serves_the_model(
    plan: KernelPlan, bf16_prompts, hf_bf16, monkeypatch, request
) -> None:
    """Whatever the chooser may pick for a bucket, the engine starts and runs it: packed
    linears, the fused CPU decoder (with its one cpu_gemm mode), the LM head, one request
    at a time and batched; and its answers meet the bf16 criterion. The pinned plan's
    engine is the module's own (`bf16_llm`, the same settings), whose answers to every
    prompt of the set test_bf16_greedy_tokens_and_logprobs_match_hf_bf16 holds to it."""
    pinned = plan == pinned_plan()
    if pinned:
        llm = request.getfixturevalue("bf16_llm")
    else:
        monkeypatch.setenv(kernel_setting.KERNEL_ENV, plan_setting(plan))
        llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16", kv_cache_memory="64MiB")
    try:
        model = llm.engine.executor.runner.model
        if packed_linear.packing_supported(torch.bfloat16, torch.device("cpu")):
            assert model.kernel_plan == plan
            # Where the plan gives a bucket to cpu_gemm, the fused decoder takes its steps.
            decoder = model.whole_stack
            own_buckets = [k.library == "own" for k in plan.by_bucket]
            assert (decoder is not None) == any(own_buckets)
            if decoder is not None:
                assert any(decoder.runs_bucket)
        if pinned:
            return
        params = SamplingParams(
            temperature=0.0, max_tokens=PLAN_NEW_TOKENS, ignore_eos=True, logprobs=0
        )
        prompts = bf16_prompts[:3]
        references = [
            Reference(r.token_ids[:PLAN_NEW_TOKENS], r.logprobs[:PLAN_NEW_TOKENS])
            for r in hf_bf16[:3]
        ]
        requests = [{"prompt_token_ids": p} for p in prompts]
        # Alone: one-row decode steps and prefills of 9-64 rows. Together: decode steps of
        # three rows and one prefill of 65-256, which a plan unlike the pinned one at one
        # row only runs as the pinned plan does.
        runs = {"alone": [llm.generate([r], params)[0] for r in requests]}
        if plan.by_bucket[1:] != pinned_plan().by_bucket[1:]:
            runs["batched"] = llm.generate(requests, params)
        for label, outputs in runs.items():
            for prompt, reference, result in zip(prompts, references, outputs, strict=True):
                ours = result.outputs[0]
                chosen = [
                    lp[t].logprob for t, lp in zip(ours.token_ids, ours.logprobs, strict=True)
                ]
                assert_agrees(f"{label}, {len(prompt)} tokens", reference, ours.token_ids, chosen)
    finally:
        if not pinned:
            del llm
            gc.collect()
