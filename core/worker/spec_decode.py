"""The model runner's side of speculative decoding: the step's draft tokens go into the
persistent batch after each row's known tokens (the model reads its input ids there),
and after the forward pass the rejection sampler turns each row's 1 + drafts logits into
its accepted drafts plus one token of the target's own, appended to the batch.

Under tensor parallelism rank 0 verifies and broadcasts each row's tokens (padded with
-1 to the longest), so that every rank's batch holds the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from plugserve.datatypes import ModelRunnerOutput
from plugserve.worker.input_batch import InputBatch
from plugserve.worker.parallel import ParallelContext
from plugserve.worker.rejection_sampler import rejection_sample


def write_drafts(batch: InputBatch, drafts: dict[str, list[int]]) -> np.ndarray | None:
    """Write the step's draft tokens after each row's known tokens; per batch row, how
    many (None when the step has none)."""
    if not drafts:
        return None
    num_drafts = np.zeros(batch.num_reqs, dtype=np.int64)
    for req_id, tokens in drafts.items():
        row = batch.req_id_to_row[req_id]
        batch.write_drafts(row, tokens)
        num_drafts[row] = len(tokens)
    return num_drafts


def verify_drafts(
    batch: InputBatch,
    logits: torch.Tensor | None,
    rows: np.ndarray,
    req_ids: list[str],
    drafts: list[list[int]],
    *,
    vocab_size: int,
    parallel: ParallelContext,
) -> ModelRunnerOutput:
    """`logits`: 1 + drafts rows per sample row, in order (grammar applied; None off the
    driver rank); `rows`, `req_ids`, `drafts`: per sample row. Appends each row's tokens
    to the batch and returns them, with the logprobs of those tokens where asked."""
    counts = np.array([len(d) + 1 for d in drafts], dtype=np.int64)
    # [rows, longest]: each row's tokens, padded with -1: what rank 0 broadcasts.
    tokens = torch.full((len(counts), int(counts.max())), -1, dtype=torch.int64)
    verified = None
    if logits is not None:
        # Entry j of a row is the row with its first j drafts taken as already generated.
        entries = np.repeat(rows, counts)
        offsets = np.arange(len(entries)) - np.repeat(np.cumsum(counts) - counts, counts)
        metadata = batch.sampling_metadata(
            entries, vocab_size, num_known=batch.num_tokens[entries] + offsets
        )
        draft_ids = torch.tensor([t for d in drafts for t in (*d, -1)], dtype=torch.int64)
        verified = rejection_sample(logits, metadata, draft_ids.to(logits.device), counts)
        for i, row_tokens in enumerate(verified.token_ids):
            tokens[i, : len(row_tokens)] = torch.tensor(row_tokens, dtype=torch.int64)
    if parallel.world_size > 1:
        device_tokens = tokens.to(batch.device)
        parallel.broadcast(device_tokens)
        tokens = device_tokens.cpu()
    token_lists = [[t for t in row if t >= 0] for row in tokens.tolist()]
    for row, row_tokens in zip(rows.tolist(), token_lists, strict=True):
        batch.append_tokens(row, row_tokens)
    result = ModelRunnerOutput(sampled_token_ids=dict(zip(req_ids, token_lists, strict=True)))
    if verified is not None and verified.logprobs is not None:
        wanted = np.repeat(batch.num_logprobs[rows], counts)
        entries_lp = verified.logprobs.to_logprobs([n if n >= 0 else None for n in wanted])
        start = 0
        for req_id, count, row_tokens in zip(req_ids, counts.tolist(), token_lists, strict=True):
            chosen = entries_lp[start : start + len(row_tokens)]
            start += count
            if chosen and chosen[0] is not None:
                result.logprobs[req_id] = [lp for lp in chosen if lp is not None]
    return result
