"""engine.batch_invariant: in bf16, a greedy request's tokens and logprobs are the same bits
whether it runs alone or batched with others, its prompt prefilled in one chunk or
several, its blocks found in the prefix cache or not, and after a preemption recomputes it.

Without the mode they are not: each row-count bucket of the bf16 kernel plan may run
another kernel, and a lone decode row splits its attention over two threads, each summing
in its own order, so batched and alone the same request's logits differ in the last bits
and a near-tie can flip. The mode runs one kernel of kernel_plan.BATCH_INVARIANT_KERNELS
for every row count and every token through one attention kernel with one order. Parts that cannot are
refused by name (here the attention kernel and a model with experts; the linear methods
in tests/unit/worker/test_linear_methods.py).
"""

from __future__ import annotations

import gc

import pytest

from plugserve import LLM, SamplingParams
from plugserve_plugins.cpu_bf16 import kernel_choice
from plugserve_plugins.cpu_bf16.kernel_plan import KernelPlan
from plugserve_plugins.cpu_bf16.kernel_setting import KERNEL_ENV
from tests.kernel_support import plan_setting

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def invariant_kernels_here() -> list[str]:
    try:
        return [k.name for k in kernel_choice.batch_invariant_candidates()[0]]
    except ValueError:
        return []


@pytest.fixture
def invariant_kernel(monkeypatch: pytest.MonkeyPatch) -> str:
    """The first kernel the mode may run here, pinned for every row count (the suite pins
    a mixed plan). Each kernel's rows are shown independent of the batch on their own in
    tests/unit/cpu_bf16/test_batch_invariance.py; this test holds the whole engine to it."""
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    if not invariant_kernels_here():
        pytest.skip("no batch-invariant bf16 kernel runs on this CPU")
    kernel = kernel_choice.batch_invariant_candidates()[0][0]
    monkeypatch.setenv(KERNEL_ENV, plan_setting(KernelPlan.single(kernel)))
    return kernel.name


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        chosen = [
            lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
        results.append((completion.token_ids, chosen))
    return results


def test_greedy_bf16_output_is_the_same_bits_alone_batched_chunked_and_preempted(
    invariant_kernel: str, mixed_prompts: list[list[int]]
) -> None:
    # 128-token chunks: the 150-400-token prompts prefill in two to four, sharing steps
    # with the others' decodes; 40 blocks of 16 tokens hold the longest request but not
    # all eight, so the batch preempts and recomputes.
    llm = LLM(
        model="smollm2-135m-instruct",
        dtype="bfloat16",
        batch_invariant=True,
        max_num_batched_tokens=128,
        num_kv_blocks=40,
    )
    try:
        batched = run(llm, mixed_prompts)
        assert llm.engine.scheduler.num_preemptions > 0
        # One at a time, in reverse, now partly from the prefix cache: other chunkings.
        alone = [run(llm, [prompt])[0] for prompt in reversed(mixed_prompts)][::-1]
    finally:
        del llm
        gc.collect()
    for prompt, together, by_itself in zip(mixed_prompts, batched, alone, strict=True):
        assert together == by_itself, f"{len(prompt)}-token prompt"


@pytest.fixture(scope="module")
def tiny_moe(tiny_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import Qwen3MoeConfig

    from correctness.tiny_checkpoints import tiny, write_tiny_checkpoint

    config = Qwen3MoeConfig(
        **tiny(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32)
    )
    return str(write_tiny_checkpoint(config, tmp_path_factory.mktemp("moe"), tiny_tokenizer))


def test_an_attention_kernel_that_cannot_keep_one_order_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"engine\.batch_invariant: .*kernel 'sdpa'"):
        LLM(
            model="smollm2-135m-instruct",
            dtype="bfloat16",
            batch_invariant=True,
            **{"plugins.torch": {"kernel": "sdpa"}},
        )


@pytest.mark.usefixtures("invariant_kernel")
def test_a_mixture_of_experts_model_is_refused_by_name(tiny_moe) -> None:
    with pytest.raises(ValueError, match=r"engine\.batch_invariant: .*expert layers"):
        LLM(model=tiny_moe, dtype="bfloat16", batch_invariant=True)
