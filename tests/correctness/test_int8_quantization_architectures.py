"""stack.linear_method int8 (W8A8) on every registered architecture (the tiny checkpoint of
the first case of each family in architecture_cases/): every Linear of the model and the
LM head, tied or not, run quantized, and the prompt's logprobs stay near the unquantized
model's.

fp32 model here (the harness's dtype): the weights are rounded to int8 with per-row
absmax/127 scales and each matmul's fp32 activations to uint8 codes per token. Held:
the mean absolute difference of the prompt tokens' logprobs, under
INT8_MEAN_LOGPROB_TOLERANCE nats. Measured over these cases: means 0.014-0.130 (Gemma 3
the largest, its activations the widest), maxima 0.05-0.76; a quantized router may flip a
near-tied expert choice and move one token's logprob by a nat: hence the mean, not the max. A wrong scale, a transposed weight, a dropped bias or
a zero point taken out wrongly moves it by whole nats.
"""

from __future__ import annotations

import pytest

from correctness.architecture_cases import one_case_per_family
from correctness.tiny_checkpoints import TinyCase, TinyRun, write_tiny_checkpoint
from plugserve import SamplingParams
from plugserve.worker.layers.linear import Linear
from plugserve_plugins.linear_methods import w8a8_plan
from plugserve_plugins.linear_methods.int8_w8a8 import W8A8Linear
from tests.kernel_support import missing_cpu_flags

# Skipped only where the CPU lacks the kernel's instructions: where it has them, a kernel
# that does not build fails these tests (and tests/unit/ops/test_kernels_build.py).
MISSING = missing_cpu_flags(w8a8_plan.REQUIRED_CPU_FLAGS)
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"the W8A8 kernel needs a CPU with {' and '.join(MISSING)}"
)

INT8_MEAN_LOGPROB_TOLERANCE = 0.2


def _prompt_logprobs(llm, prompt: list[int]) -> list[float]:
    [out] = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    assert out.prompt_logprobs is not None
    return [
        entry[token].logprob
        for token, entry in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)
    ]


@pytest.mark.parametrize("case", one_case_per_family(), ids=lambda case: case.id)
def test_int8_quantizes_every_linear_and_keeps_the_prompt_logprobs(
    case: TinyCase, tmp_path, tiny_tokenizer, tiny_prompts
) -> None:
    folder = write_tiny_checkpoint(case.config, tmp_path / case.id, tiny_tokenizer)
    run = TinyRun(str(folder), tiny_prompts, [])
    prompt = max(tiny_prompts, key=len)
    with run.llm() as llm:
        reference = _prompt_logprobs(llm, prompt)
    with run.llm(linear_method="int8") as llm:
        model = llm.engine.executor.runner.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and all(isinstance(m.packed, W8A8Linear) for m in linears)
        if model.lm_head is None:  # tied: the embedding's head
            assert isinstance(model.model.embed_tokens.packed_head, W8A8Linear)
        ours = _prompt_logprobs(llm, prompt)
    differences = [abs(a - b) for a, b in zip(reference, ours, strict=True)]
    mean = sum(differences) / len(differences)
    print(f"{case.id}: prompt logprob difference mean {mean:.3f}, max {max(differences):.3f}")
    assert mean < INT8_MEAN_LOGPROB_TOLERANCE
