"""What `execute_model` leaves for `sample_tokens`: the logits of the rows that sample this
step, and the per-row facts sampling needs (grammar masks, logprobs lists)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from plugserve.datatypes import GrammarOutput, Logprobs
from plugserve.worker.sampler import LogprobsTensors, apply_grammar_bitmask


@dataclass
class ParkedLogits:
    logits: torch.Tensor | None  # [num_sampling_rows, vocab]; None off the driver rank
    rows: np.ndarray  # persistent-batch rows, in logits order
    req_ids: list[str]
    # prompt_logprobs computed by this step's prefill chunks (driver rank), by request
    prompt_logprobs: dict[str, list[Logprobs]] | None = None
    # Speculative decoding: each sample row's draft tokens (maybe none), in rows order;
    # its logits are then 1 + drafts rows. None: no row verifies drafts this step.
    drafts: list[list[int]] | None = None

    def apply_grammar(
        self, grammar_output: GrammarOutput, counts: np.ndarray | None = None
    ) -> None:
        """Mask the logits of the constrained rows (in place; the others untouched).
        `counts`: logits rows per sample row when rows verify drafts (the grammar output
        then holds as many rows for each, in order)."""
        assert self.logits is not None
        if counts is None:
            first = {req_id: i for i, req_id in enumerate(self.req_ids)}
        else:
            starts = (np.cumsum(counts) - counts).tolist()
            first = dict(zip(self.req_ids, starts, strict=True))
        bitmask = grammar_output.bitmask_array()
        seen: dict[str, int] = {}
        pairs = []
        for i, req_id in enumerate(grammar_output.req_ids):
            if req_id in first:
                pairs.append((first[req_id] + seen.get(req_id, 0), i))
                seen[req_id] = seen.get(req_id, 0) + 1
        if pairs:
            logits_rows, mask_rows = zip(*pairs, strict=True)
            apply_grammar_bitmask(self.logits, logits_rows, bitmask[list(mask_rows)])

    def logprobs_lists(
        self, num_logprobs: np.ndarray, tensors: LogprobsTensors
    ) -> dict[str, list[Logprobs]]:
        """Each sampled request's logprobs entry; `num_logprobs` holds, by persistent-batch
        row, how many alternatives the request asked for (negative: none)."""
        wanted = [n if n >= 0 else None for n in num_logprobs[self.rows].tolist()]
        rows = tensors.to_logprobs(wanted)
        return {rid: [lp] for rid, lp in zip(self.req_ids, rows, strict=True) if lp is not None}
