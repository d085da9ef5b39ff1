"""How a bfloat16 continuation is compared with Hugging Face's bfloat16 one.

fp32 is compared exactly (tests/correctness/test_greedy_matches_hf.py). bf16 cannot be:
both stacks round a logit to 8 significant bits (one unit in the last place is 0.125 at
this model's logit sizes, 16-32) after summing in different orders (packed or
exponent-coded matmuls, the fused decoder, the paged attention kernel), so two tokens
whose logits are one such unit apart can swap. The criterion, per prompt:

- The first token agrees. Every prompt of a bf16 set has a first token Hugging Face
  prefers by more than NEAR_TIE (`assert_clear_first_tokens` checks the set), so a
  first token that differs is a wrong prediction, not a tie broken the other way.
- At every position up to and including the first divergence, plugserve's logprob of
  the token it chose is within LOGPROB_TOLERANCE of Hugging Face's logprob of that same
  token. Measured on a 2-core AMD EPYC Zen 4 (no AMX) over 19 prompts of 5-400 tokens,
  32 tokens each: one engine, batched and one at a time, median 0.015, 99th percentile
  0.15, largest 0.21 nats; tensor-parallel over two ranks, whose all-reduce rounds each
  layer's sum to bf16 once more, median 0.013, 99th percentile 0.14, largest 0.32. The
  bound is three units of a bf16 logit at this model's sizes, plus a little.
- Where the continuations first differ, Hugging Face itself scores the two tokens within
  NEAR_TIE of each other (measured: 0, 0.125 or 0.25, up to two units of a bf16 logit):
  a near-tie. After it the two continue from different text and are not compared.

No count of agreeing tokens enters: a continuation that diverges early at a true tie
passes, one that diverges anywhere at a clear preference fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

LOGPROB_TOLERANCE = 0.4
NEAR_TIE = 0.375  # three units of a bf16 logit in [16, 32)
# A difference of two logprobs computed in fp32 from bf16 logits three units apart can come
# out a hair above 0.375 (seen on a 2-core Xeon with AMX: HF's own gap of 0.37500x).
_FP32_SLACK = 1e-3


@dataclass(frozen=True)
class Reference:
    """Hugging Face's greedy continuation and the log-softmax of its logits at each step."""

    token_ids: list[int]
    logprobs: torch.Tensor  # [steps, vocab], fp32

    def margin(self, step: int) -> float:
        """How much Hugging Face prefers its token over the runner-up at `step`."""
        top = self.logprobs[step].topk(2).values
        return (top[0] - top[1]).item()


def clear_first_tokens(references: Sequence[Reference]) -> list[bool]:
    """Per reference, whether Hugging Face prefers its first token by more than NEAR_TIE.
    Which prompts start at a near-tie depends on the machine (its bf16 matmuls sum in
    their own order): on a Zen 4 the 150-token corpus prompt, on a Xeon with AMX the
    47-token one."""
    return [reference.margin(0) > NEAR_TIE + _FP32_SLACK for reference in references]


def assert_clear_first_tokens(references: Sequence[Reference], prompts: Sequence[object]) -> None:
    """The set's precondition: no prompt starts at a near-tie."""
    for prompt, reference in zip(prompts, references, strict=True):
        margin = reference.margin(0)
        assert margin > NEAR_TIE + _FP32_SLACK, (
            f"{prompt!r}: first token is a near-tie ({margin:.3f})"
        )


def assert_agrees(
    label: str, reference: Reference, token_ids: Sequence[int], logprobs: Sequence[float]
) -> int:
    """`token_ids` and plugserve's logprob of each against `reference` by the criterion
    above; returns the position of the first divergence (len(token_ids) if none)."""
    assert len(token_ids) == len(logprobs) == len(reference.token_ids), label
    assert token_ids[0] == reference.token_ids[0], (
        f"{label}: first token {token_ids[0]}, Hugging Face {reference.token_ids[0]}"
    )
    for step, (theirs, mine) in enumerate(zip(reference.token_ids, token_ids, strict=True)):
        expected = reference.logprobs[step, mine].item()
        assert abs(logprobs[step] - expected) <= LOGPROB_TOLERANCE, (
            f"{label}, step {step}: logprob of {mine} is {logprobs[step]:.3f}, "
            f"Hugging Face's {expected:.3f}"
        )
        if theirs != mine:
            gap = (reference.logprobs[step, theirs] - reference.logprobs[step, mine]).item()
            assert gap <= NEAR_TIE + _FP32_SLACK, (
                f"{label}, step {step}: Hugging Face prefers {theirs} over {mine} by {gap:.3f}"
            )
            return step
    return len(token_ids)
