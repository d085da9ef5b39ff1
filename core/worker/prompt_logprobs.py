"""Prompt logprobs: the logprob of each prompt token a step's prefill chunks predict, for
the requests that asked (SamplingParams.prompt_logprobs), from the step's hidden states.
The model runner calls it after the forward pass, before the logits of the sampled rows
are parked.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from plugserve.datatypes import Logprobs, SchedulerOutput
from plugserve.worker.input_batch import InputBatch
from plugserve.worker.sampler import token_logprobs

# Prompt logprobs are computed over at most this many tokens at once: a whole prefill's
# fp32 logits (tokens × vocabulary) would be hundreds of MB.
PROMPT_LOGPROBS_CHUNK = 256


def prompt_logprobs_of_step(
    so: SchedulerOutput,
    batch: InputBatch,
    query_start: np.ndarray,
    hidden: torch.Tensor,
    model: Any,
) -> dict[str, list[Logprobs]] | None:
    """Logprobs of the prompt tokens this step's chunks predict, for the rows that
    asked: the hidden state at position q gives prompt token q + 1's logprob. Every
    rank computes the logits (a collective under tensor parallelism); the driver keeps
    the result."""
    # The step's rows in the order of its tokens (StepInputBuilder's order: by row).
    rows = np.sort([batch.req_id_to_row[r] for r in so.num_scheduled_tokens])
    indices, targets, owners = [], [], []
    for k, row in enumerate(rows.tolist()):
        if batch.num_prompt_logprobs[row] < 0:
            continue
        start = int(batch.num_computed_tokens[row])
        end = min(start + so.num_scheduled_tokens[batch.req_ids[row]],
                  int(batch.num_prompt_tokens[row]) - 1)  # fmt: skip
        if end <= start:
            continue
        first = int(query_start[k])
        indices.append(np.arange(first, first + end - start))
        targets.append(batch.token_ids[row, start + 1 : end + 1])
        owners.append((batch.req_ids[row], end - start, int(batch.num_prompt_logprobs[row])))
    if not indices:
        return None
    index = torch.from_numpy(np.concatenate(indices)).to(hidden.device)
    target = torch.from_numpy(np.concatenate(targets)).to(hidden.device)
    top_n = max(n for _, _, n in owners)
    found: list[Logprobs | None] = []
    for lo in range(0, len(index), PROMPT_LOGPROBS_CHUNK):
        part = slice(lo, lo + PROMPT_LOGPROBS_CHUNK)
        logits = model.compute_logits(hidden[index[part]])
        if logits is not None:
            tensors = token_logprobs(logits, target[part], top_n)
            found += tensors.to_logprobs([top_n] * len(target[part]))
    if not found:  # not the driver rank
        return None
    result: dict[str, list[Logprobs]] = {}
    offset = 0
    for req_id, count, n in owners:
        entries = found[offset : offset + count]
        offset += count
        result[req_id] = [
            Logprobs(lp.sampled_logprob, lp.sampled_rank, lp.top_token_ids[:n], lp.top_logprobs[:n])
            for lp in entries
            if lp is not None
        ]
    return result
