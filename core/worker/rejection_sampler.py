"""Speculative decoding's verification (phase 8 for rows with draft tokens): from the
target model's logits at every draft position, keep the longest prefix of the draft the
target agrees with, then add one token of the target's own.

A request with k drafts has k + 1 logits rows: row j predicts the token after draft j - 1
(row 0 the token after the known ones). Each row is processed exactly as the sampler
processes a row without speculation (allowed_token_ids, bad words, logit_bias,
penalties over the output as if the drafts before it had been generated; then
temperature, min_p, top_k, top_p) into the target distribution p_j.

- Greedy rows: draft j is accepted while it equals argmax p_j; the first row that
  disagrees, or the last row when all agree, gives its argmax. The output is the
  target's greedy continuation, token for token.
- Random rows: the standard speculative-sampling scheme (Leviathan et al., Chen et al.):
  draft j, drawn from the draft distribution q_j, is accepted with probability
  min(1, p_j(d) / q_j(d)); on the first rejection a token is drawn from
  max(p_j - q_j, 0), renormalized; when all are accepted the last row gives a token
  drawn from p_k. Every emitted token is then distributed exactly as p_j. A proposer
  that gives no distribution (n-gram lookup) proposes with certainty, q_j = 1 at d.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from plugserve.sampling_params import _GREEDY_EPS
from plugserve.worker import cpu_ops
from plugserve.worker.sampler import (
    LogprobsTensors,
    SamplingMetadata,
    apply_penalties,
    apply_token_edits,
    exponential_race,
    gather_logprobs,
    random_probs,
    uniform_noise,
)


@dataclass
class VerifiedTokens:
    # Per request: its accepted drafts then the target's own token (at least one).
    token_ids: list[list[int]]
    # Per logits row, of the token emitted at that row (rows past a request's emitted
    # tokens are meaningless); None when no row asked for logprobs.
    logprobs: LogprobsTensors | None


def rejection_sample(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    draft_token_ids: torch.Tensor,
    counts: np.ndarray,
    draft_probs: torch.Tensor | None = None,
) -> VerifiedTokens:
    """`logits`: [N, V] raw target logits (grammar already applied), N = sum(counts);
    `metadata`: one entry per logits row; `draft_token_ids`: int64 [N], row j of a
    request holds its draft j, and its last row -1 (no draft there); `counts`: logits
    rows per request (its drafts + 1); `draft_probs`: [N, V] the draft distribution each
    draft token was drawn from, or None for drafts proposed with certainty."""
    raw_logprobs = None
    if metadata.max_num_logprobs is not None:
        raw_logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    work = logits.to(dtype=torch.float32, copy=True)
    work = apply_token_edits(work, metadata)
    work = apply_penalties(work, metadata)
    has_draft = draft_token_ids >= 0
    drafts = draft_token_ids.clamp_min(0)

    greedy = None if metadata.all_random else cpu_ops.argmax(work)
    if metadata.all_greedy:
        assert greedy is not None
        accepted = has_draft & (drafts == greedy)
        emitted = torch.where(accepted, drafts, greedy)
    else:
        accepted, recovered = _accept_random(work, metadata, drafts, has_draft, draft_probs)
        emitted = torch.where(accepted, drafts, recovered)
        if greedy is not None:
            is_greedy = metadata.temperature < _GREEDY_EPS
            greedy_accepted = has_draft & (drafts == greedy)
            accepted = torch.where(is_greedy, greedy_accepted, accepted)
            emitted = torch.where(is_greedy, torch.where(greedy_accepted, drafts, greedy), emitted)

    accepted_np = accepted.cpu().numpy()
    emitted_np = emitted.cpu().numpy()
    token_ids: list[list[int]] = []
    start = 0
    for count in counts.tolist():
        rejected = np.flatnonzero(~accepted_np[start : start + count])
        # The last row never accepts (it holds no draft), so a first rejection exists.
        num_accepted = int(rejected[0])
        token_ids.append(emitted_np[start : start + num_accepted + 1].tolist())
        start += count

    logprobs = None
    if raw_logprobs is not None and metadata.max_num_logprobs is not None:
        logprobs = gather_logprobs(raw_logprobs, emitted, metadata.max_num_logprobs)
    return VerifiedTokens(token_ids=token_ids, logprobs=logprobs)


def _accept_random(
    work: torch.Tensor,
    metadata: SamplingMetadata,
    drafts: torch.Tensor,
    has_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted, recovered) per row: whether the row's draft is accepted, and the token
    the row gives if it is not (drawn from the residual distribution; from p itself on a
    row without a draft)."""
    probs = random_probs(work, metadata)
    target_at_draft = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
    # One uniform per row for the acceptance test, drawn before the recovery noise so a
    # seeded request's draws come in a fixed order.
    u = uniform_noise(target_at_draft.unsqueeze(1), metadata.generators).squeeze(1)
    if draft_probs is None:
        accepted = has_draft & (u < target_at_draft)
        residual = probs.scatter(1, drafts.unsqueeze(1), 0.0)
    else:
        draft_at_draft = draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
        accepted = has_draft & (u * draft_at_draft < target_at_draft)
        residual = (probs - draft_probs).clamp_min_(0.0)
    # Rows without a draft give a token from p itself.
    residual = torch.where(has_draft.unsqueeze(1), residual, probs)
    # The race needs no normalization: it picks i with probability residual_i / sum.
    recovered = exponential_race(residual, metadata.generators)
    return accepted, recovered
