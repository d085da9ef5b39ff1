"""A step's flat model inputs, built from the persistent batch into reused numpy buffers.

The per-token arrays (input ids, positions, KV slots) and the per-row ones (query starts,
sequence lengths) are written with numpy's `out=` into buffers allocated once for the
engine's token budget, so a step allocates only the few temporaries numpy's repeat and
fancy indexing make. The arrays returned are views into those buffers: valid until the
next `build`, which is the next step (the model runner consumes them within its step).

A step that gives every row of the batch one token (a decode step without prefills, the
most common one) takes a shorter path to the same arrays: half the numpy calls, which
matter because each one runs cold after the weights' stream (5-18 us a call, not ~1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plugserve.interfaces.model import AttentionBatch
from plugserve.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    input_ids: np.ndarray  # int64 [tokens]
    positions: np.ndarray  # int64 [tokens]
    attention: AttentionBatch
    query_lens: np.ndarray  # int64 [rows]
    # Rows that reach the end of their known tokens sample this step; a prefill chunk
    # that stops short computes no logits at all.
    sample_rows: np.ndarray  # a fresh array: it outlives the step (parked logits)
    # int64: each sample row's last token, or, where a row verifies draft tokens, its
    # last 1 + drafts tokens (a row's logits stay together, in position order).
    logits_indices: np.ndarray
    # Logits rows of each sample row (1 + its drafts); None: one each (no drafts).
    logits_counts: np.ndarray | None = None


class StepInputBuilder:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, block_size: int) -> None:
        self.block_size = block_size
        self._allocate_tokens(max_num_tokens)
        self._num_scheduled = np.zeros(max_num_reqs, dtype=np.int64)
        self._query_start = np.zeros(max_num_reqs + 1, dtype=np.int32)
        self._seq_lens = np.zeros(max_num_reqs, dtype=np.int32)
        self._logits_indices = np.zeros(max_num_reqs, dtype=np.int64)
        self._row_starts = np.arange(max_num_reqs + 1, dtype=np.int32)  # one token a row
        self._ones = np.ones(max_num_reqs, dtype=np.int64)

    def _allocate_tokens(self, num_tokens: int) -> None:
        self._arange = np.arange(num_tokens, dtype=np.int64)
        self._input_ids = np.zeros(num_tokens, dtype=np.int64)
        self._positions = np.zeros(num_tokens, dtype=np.int64)
        self._slots = np.zeros(num_tokens, dtype=np.int64)
        self._block_index = np.zeros(num_tokens, dtype=np.int64)
        self._offset = np.zeros(num_tokens, dtype=np.int64)

    def build(
        self,
        batch: InputBatch,
        num_scheduled_tokens: dict[str, int],
        num_drafts: np.ndarray | None = None,
    ) -> StepInputs:
        """`num_drafts`: per batch row, the draft tokens scheduled after its known ones
        (speculative decoding; written in the batch's token ids past its count); None:
        none this step."""
        num_reqs = batch.num_reqs
        if num_drafts is None and (
            len(num_scheduled_tokens) == num_reqs == sum(num_scheduled_tokens.values())
        ):
            return self._one_token_per_row(batch)
        scheduled = self._num_scheduled[:num_reqs]
        scheduled.fill(0)
        for req_id, n in num_scheduled_tokens.items():
            scheduled[batch.req_id_to_row[req_id]] = n
        rows = np.flatnonzero(scheduled)
        query_lens = scheduled[rows]
        starts = batch.num_computed_tokens[rows]
        query_start = self._query_start[: len(rows) + 1]
        np.cumsum(query_lens, out=query_start[1:])
        total = int(query_start[-1])
        if total > len(self._arange):  # never under the scheduler's token budget
            self._allocate_tokens(total)

        # Token t of row r sits at position starts[r] + (t - query_start[r]).
        token_rows = np.repeat(rows, query_lens)
        positions = self._positions[:total]
        np.add(
            np.repeat(starts - query_start[:-1], query_lens), self._arange[:total], out=positions
        )
        input_ids, slots = self._ids_and_slots(batch, token_rows, positions)

        seq_lens = self._seq_lens[: len(rows)]
        np.add(starts, query_lens, out=seq_lens, casting="unsafe")
        max_blocks = int(batch.num_blocks[rows].max())
        if num_drafts is None:
            samples = seq_lens == batch.num_tokens[rows]
            num_samples = int(samples.sum())
            logits_indices = self._logits_indices[:num_samples]
            np.subtract(query_start[1:][samples], 1, out=logits_indices, casting="unsafe")
            logits_counts = None
        else:
            samples = seq_lens == batch.num_tokens[rows] + num_drafts[rows]
            logits_counts = num_drafts[rows][samples] + 1
            first = np.repeat(query_start[1:][samples] - logits_counts, logits_counts)
            group_start = np.repeat(np.cumsum(logits_counts) - logits_counts, logits_counts)
            logits_indices = first + (np.arange(len(first)) - group_start)
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            attention=AttentionBatch(
                query_start_loc=query_start,
                seq_lens=seq_lens,
                block_table=batch.block_table[rows, :max_blocks],
                slot_mapping=slots,
            ),
            query_lens=query_lens,
            sample_rows=rows[samples],
            logits_indices=logits_indices,
            logits_counts=logits_counts,
        )

    def _one_token_per_row(self, batch: InputBatch) -> StepInputs:
        """build() where every row is scheduled for exactly one token: row r's token is
        token r, at position num_computed_tokens[r]."""
        n = batch.num_reqs
        rows = self._arange[:n]
        positions = self._positions[:n]
        np.copyto(positions, batch.num_computed_tokens[:n])
        input_ids, slots = self._ids_and_slots(batch, rows, positions)
        seq_lens = np.add(positions, 1, out=self._seq_lens[:n], casting="unsafe")
        # All but a prompt's one-token chunk that stops short of its end; row r is token r.
        sample_rows = np.flatnonzero(seq_lens == batch.num_tokens[:n])
        logits_indices = self._logits_indices[: len(sample_rows)]
        logits_indices[:] = sample_rows
        max_blocks = int(batch.num_blocks[:n].max())
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            attention=AttentionBatch(
                query_start_loc=self._row_starts[: n + 1],
                seq_lens=seq_lens,
                block_table=np.ascontiguousarray(batch.block_table[:n, :max_blocks]),
                slot_mapping=slots,
            ),
            query_lens=self._ones[:n],
            sample_rows=sample_rows,
            logits_indices=logits_indices,
        )

    def _ids_and_slots(
        self, batch: InputBatch, token_rows: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each token's id and KV cache slot, from its row and position."""
        n = len(positions)
        input_ids = self._input_ids[:n]
        input_ids[:] = batch.token_ids[token_rows, positions]
        block_index, offset = np.divmod(
            positions, self.block_size, out=(self._block_index[:n], self._offset[:n])
        )
        slots = np.multiply(
            batch.block_table[token_rows, block_index], self.block_size, out=self._slots[:n]
        )
        slots += offset
        return input_ids, slots
