"""Specification of the rejection sampler (speculative decoding's verification).

Greedy: the output is the target's argmax continuation, exactly. Random: every emitted
token is distributed as the target's processed distribution p (logit_bias, penalties,
temperature, top_k applied), whatever the draft; checked by a chi-square test over
DRAFTS independent drafts on a six-token vocabulary, at significance ALPHA.

Power: with N draws and a true distribution p' at total-variation distance d from p, the
statistic is noncentral chi-square with 5 degrees of freedom and noncentrality
N * sum((p' - p)^2 / p) >= N * (2d)^2 (Cauchy-Schwarz, as sum(p) = 1). At N = 40000 and
d = 0.02 that is >= 64, which exceeds CHI2_CRITICAL with probability above 0.9999: a
sampler off by 2 % of mass anywhere fails. (Accepting every draft as proposed would put
the first token at the draft's distribution, off by far more.)
"""

from __future__ import annotations

import numpy as np
import torch

from plugserve.worker.rejection_sampler import rejection_sample
from plugserve.worker.sampler import SamplingMetadata, TokenEdits

VOCAB = 6
DRAFTS = 40000
ALPHA = 0.001
CHI2_CRITICAL = 20.515  # chi-square, 5 degrees of freedom, upper 0.001 quantile

LOGITS = torch.tensor(
    [
        [2.0, 1.5, 1.2, 0.3, -0.5, 0.9],  # where the draft token is checked
        [0.1, 0.4, 2.2, 1.0, 0.0, -1.0],  # the token after an accepted draft
    ]
)
TEMPERATURE = 0.7
TOP_K = 5
BIAS = {4: 1.5}  # logit_bias: token 4 gains, making it more likely than without
FREQUENCY_PENALTY = 0.5
OUTPUT_SO_FAR = [0, 0, 1]  # what the penalty counts (row 1 also counts its draft)


def expected_target(row: int, draft: int | None) -> np.ndarray:
    """p for a logits row, computed here by hand: bias, frequency penalty over the output
    so far (plus the draft before the row), temperature, top-k, softmax."""
    z = LOGITS[row].double().numpy().copy()
    for token, bias in BIAS.items():
        z[token] += bias
    seen = OUTPUT_SO_FAR + ([draft] if draft is not None else [])
    for token in seen:
        z[token] -= FREQUENCY_PENALTY
    z /= TEMPERATURE
    z[np.argsort(z)[: VOCAB - TOP_K]] = -np.inf
    p = np.exp(z - z.max())
    return p / p.sum()


def metadata_for(drafts: torch.Tensor) -> SamplingMetadata:
    """Two rows per draft: the draft's row, then the row after it, whose output so far
    includes the draft."""
    rows = 2 * len(drafts)
    outputs = torch.tensor(OUTPUT_SO_FAR).repeat(rows, 1)
    with_draft = torch.cat([outputs, torch.full((rows, 1), VOCAB)], dim=1)
    with_draft[1::2, -1] = drafts
    bias_rows = torch.arange(rows).repeat_interleave(len(BIAS))
    return SamplingMetadata(
        temperature=torch.full((rows,), TEMPERATURE),
        all_greedy=False,
        all_random=True,
        top_k=torch.full((rows,), TOP_K, dtype=torch.int64),
        max_top_k=TOP_K,
        frequency_penalties=torch.full((rows,), FREQUENCY_PENALTY),
        output_token_ids=with_draft,
        logit_bias=TokenEdits(
            rows=bias_rows,
            token_ids=torch.tensor(list(BIAS)).repeat(rows),
            values=torch.tensor(list(BIAS.values()), dtype=torch.float32).repeat(rows),
        ),
    )


def chi_square(counts: np.ndarray, expected: np.ndarray) -> float:
    n = counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target rules out was emitted"
    return float(((counts[keep] - n * expected[keep]) ** 2 / (n * expected[keep])).sum())


def run(drafts: torch.Tensor, draft_probs: torch.Tensor | None) -> list[list[int]]:
    logits = LOGITS.repeat(len(drafts), 1)
    draft_ids = torch.stack([drafts, torch.full_like(drafts, -1)], dim=1).flatten()
    counts = np.full(len(drafts), 2)
    out = rejection_sample(logits, metadata_for(drafts), draft_ids, counts, draft_probs)
    return out.token_ids


def check_distribution(emitted: list[list[int]], drafts: torch.Tensor) -> None:
    first = np.bincount([tokens[0] for tokens in emitted], minlength=VOCAB)
    assert chi_square(first, expected_target(0, None)) < CHI2_CRITICAL
    # After an accepted draft d, the second token follows row 1's p given d.
    for d in range(VOCAB):
        seconds = [
            t[1] for t, x in zip(emitted, drafts.tolist(), strict=True) if x == d and len(t) == 2
        ]
        if len(seconds) >= 2000:
            counts = np.bincount(seconds, minlength=VOCAB)
            assert chi_square(counts, expected_target(1, d)) < CHI2_CRITICAL
    # Two tokens exactly when the draft was accepted, and then the first one is the draft.
    assert all(t[0] == d for t, d in zip(emitted, drafts.tolist(), strict=True) if len(t) == 2)


def test_drafts_proposed_with_certainty_leave_the_target_distribution() -> None:
    torch.manual_seed(0)
    # A fixed guess per request, as n-gram lookup makes: half of them the target's
    # likeliest token, half a token it rarely picks.
    drafts = torch.tensor([0, 3]).repeat(DRAFTS // 2)
    emitted = run(drafts, None)
    check_distribution(emitted, drafts)
    accepted = np.mean([len(t) == 2 for t in emitted])
    p = expected_target(0, None)
    assert abs(accepted - (p[0] + p[3]) / 2) < 0.01  # accepted with probability p(d)


def test_drafts_drawn_from_a_draft_distribution_leave_the_target_distribution() -> None:
    torch.manual_seed(1)
    q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.2, 0.1])  # a poor draft model's guess
    drafts = torch.multinomial(q, DRAFTS, replacement=True)
    draft_probs = torch.stack([q, torch.zeros(VOCAB)]).repeat(DRAFTS, 1)
    emitted = run(drafts, draft_probs)
    check_distribution(emitted, drafts)
    p = torch.from_numpy(expected_target(0, None)).float()
    accepted = np.mean([len(t) == 2 for t in emitted])
    assert abs(accepted - torch.minimum(p, q).sum().item()) < 0.01


def test_greedy_keeps_the_drafts_up_to_the_first_disagreement_then_the_argmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4 + 1 + 3, 50)
    best = logits.argmax(dim=-1).tolist()
    # Request 0: 3 drafts, the second wrong; request 1: none; request 2: 2 drafts, right.
    wrong = (best[1] + 1) % 50
    draft_ids = torch.tensor([best[0], wrong, best[2], -1, -1, best[5], best[6], -1])
    metadata = SamplingMetadata(temperature=torch.zeros(8), all_greedy=True, all_random=False)
    out = rejection_sample(logits, metadata, draft_ids, np.array([4, 1, 3]))
    assert out.token_ids == [[best[0], best[1]], [best[4]], [best[5], best[6], best[7]]]
    assert out.logprobs is None
