"""The persistent batch: requests keep their row between steps.

Only what SchedulerOutput changes is applied each step (rows added, removed, blocks
appended, progress set); per-row state lives in preallocated numpy arrays so that step
inputs are built by vectorized indexing, not per-token Python.
"""

from __future__ import annotations

import numpy as np
import torch

from plugserve.datatypes import NewRequestData
from plugserve.sampling_params import SamplingParams
from plugserve.worker.sampler import SamplingMetadata, TokenEdits, make_padded_token_tensor


class InputBatch:
    def __init__(
        self,
        *,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.req_ids: list[str] = []  # row i holds req_ids[i]; rows stay dense
        self.req_id_to_row: dict[str, int] = {}
        # Bumped whenever rows are removed (and others moved into their place): what is
        # derived from given rows' sampling parameters (the sampler's metadata) holds while
        # it stays the same. Adding a row leaves every existing row as it was.
        self.version = 0

        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: none asked
        # prompt_logprobs' top-N for rows whose prefill computes them; -1: none (not asked,
        # or a request resumed after preemption, whose prompt logprobs were already sent).
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)

        # Seeded requests keep their generator across preemption, so a resumed request
        # draws the same noise it would have drawn without being preempted.
        self.generators: dict[str, torch.Generator] = {}
        # The rare per-request options, by request id (so moving a row moves nothing):
        # allowed_token_ids, bad words (token sequences) and logit_bias.
        self.allowed_token_ids: dict[str, list[int]] = {}
        self.bad_words: dict[str, list[list[int]]] = {}
        self.logit_bias: dict[str, dict[int, float]] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # ------------------------------------------------------------------ changes

    def add_request(self, new: NewRequestData) -> None:
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        self.req_ids.append(new.req_id)
        self.req_id_to_row[new.req_id] = row

        num_prompt = len(new.prompt_token_ids)
        num_tokens = num_prompt + len(new.output_token_ids)
        self.token_ids[row, :num_prompt] = new.prompt_token_ids
        self.token_ids[row, num_prompt:num_tokens] = new.output_token_ids
        self.num_prompt_tokens[row] = num_prompt
        self.num_tokens[row] = num_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        self._set_sampling_params(row, new.req_id, new.sampling_params)
        wanted = new.sampling_params.prompt_logprobs
        self.num_prompt_logprobs[row] = (
            wanted if wanted is not None and not new.output_token_ids else -1
        )

    def _set_sampling_params(self, row: int, req_id: str, params: SamplingParams) -> None:
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        for store, value in (
            (self.allowed_token_ids, params.allowed_token_ids),
            (self.bad_words, params.bad_words_token_ids),
            (self.logit_bias, params.logit_bias),
        ):
            if value:
                store[req_id] = value  # type: ignore[index]
        if params.seed is not None and req_id not in self.generators:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
            self.generators[req_id] = generator

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove_requests(self, req_ids: set[str], finished: set[str]) -> None:
        """Drop rows (finished, aborted or preempted) and close the gaps by moving rows
        from the end. Generators of truly finished requests are dropped too."""
        self.version += 1
        for req_id in finished:
            self.generators.pop(req_id, None)
        for store in (self.allowed_token_ids, self.bad_words, self.logit_bias):
            if store:
                for req_id in req_ids:
                    store.pop(req_id, None)  # type: ignore[attr-defined]
        rows = sorted(
            (self.req_id_to_row.pop(r) for r in req_ids if r in self.req_id_to_row), reverse=True
        )
        for row in rows:
            last = self.num_reqs - 1
            if row != last:
                self._move_row(last, row)
            self.req_ids.pop()

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        self.req_ids[dst] = req_id
        self.req_id_to_row[req_id] = dst
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = self.num_blocks[src]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for array in (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            self.num_blocks,
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.num_logprobs,
            self.num_prompt_logprobs,
        ):
            array[dst] = array[src]

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def write_drafts(self, row: int, token_ids: list[int]) -> None:
        """Speculative decoding: draft tokens to verify, written after the row's known
        tokens (the model reads its input ids from here) without counting as known."""
        start = self.num_tokens[row]
        self.token_ids[row, start : start + len(token_ids)] = token_ids

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        start = self.num_tokens[row]
        self.token_ids[row, start : start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    # ------------------------------------------------------------------ reads

    def sampling_metadata(
        self, rows: np.ndarray, vocab_size: int, num_known: np.ndarray | None = None
    ) -> SamplingMetadata:
        """The sampler's inputs for the given rows, in that order (the logits' row order).

        Optional tensors are left None when no row uses their feature, so the sampler can
        skip it without reading the tensors (no host sync). `num_known`: per entry, how
        many of its row's tokens count as written so far (penalties and bad words read
        them); by default the row's own count. A row may appear more than once with
        different counts: speculative decoding samples at each draft position as if the
        drafts before it had been generated.
        """
        ends = self.num_tokens[rows] if num_known is None else num_known
        device = self.device
        temperature = self.temperature[rows]
        greedy = temperature == 0.0

        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values)).to(device)

        # top_k / top_p / min_p only shape the random rows, so greedy rows never turn
        # them on.
        def optional(values: np.ndarray, neutral: float) -> torch.Tensor | None:
            return tensor(values) if np.any(values[~greedy] != neutral) else None

        top_k = self.top_k[rows]
        enabled_k = top_k[(top_k > 0) & (top_k < vocab_size) & ~greedy]
        top_p = self.top_p[rows]
        min_p = self.min_p[rows]
        presence = self.presence_penalty[rows]
        frequency = self.frequency_penalty[rows]
        repetition = self.repetition_penalty[rows]
        use_penalties = bool(
            np.any(presence != 0) or np.any(frequency != 0) or np.any(repetition != 1)
        )
        prompt_ids = output_ids = None
        if use_penalties:
            prompt_ids = make_padded_token_tensor(
                [self.token_ids[r, : self.num_prompt_tokens[r]] for r in rows],
                vocab_size,
                device,
            )
            output_ids = make_padded_token_tensor(
                [
                    self.token_ids[r, self.num_prompt_tokens[r] : end]
                    for r, end in zip(rows, ends, strict=True)
                ],
                vocab_size,
                device,
            )
        num_logprobs = self.num_logprobs[rows]
        req_ids = [self.req_ids[r] for r in rows.tolist()]
        generators = {
            i: self.generators[rid] for i, rid in enumerate(req_ids) if rid in self.generators
        }
        return SamplingMetadata(
            disallowed=self._disallowed(req_ids, vocab_size),
            bad_words=self._bad_word_bans(rows, ends, req_ids),
            logit_bias=self._logit_bias(req_ids, vocab_size),
            temperature=tensor(temperature),
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            top_k=optional(top_k, 0),
            max_top_k=int(enabled_k.max()) if len(enabled_k) else 1,
            top_p=optional(top_p, 1.0),
            min_p=optional(min_p, 0.0),
            generators=generators,
            presence_penalties=tensor(presence) if use_penalties else None,
            frequency_penalties=tensor(frequency) if use_penalties else None,
            repetition_penalties=tensor(repetition) if use_penalties else None,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            max_num_logprobs=int(num_logprobs.max()) if np.any(num_logprobs >= 0) else None,
        )

    def _disallowed(self, req_ids: list[str], vocab_size: int) -> torch.Tensor | None:
        """allowed_token_ids as a [B, V] mask of what may not be sampled."""
        if not self.allowed_token_ids:
            return None
        limited = [(i, self.allowed_token_ids.get(r)) for i, r in enumerate(req_ids)]
        limited = [(i, ids) for i, ids in limited if ids]
        if not limited:
            return None
        mask = np.zeros((len(req_ids), vocab_size), dtype=np.bool_)
        rows = np.array([i for i, _ in limited], dtype=np.int64)
        mask[rows] = True
        row_of = np.repeat(rows, [len(ids) for _, ids in limited])
        tokens = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in limited])
        keep = (tokens >= 0) & (tokens < vocab_size)
        mask[row_of[keep], tokens[keep]] = False
        return torch.from_numpy(mask).to(self.device)

    def _bad_word_bans(
        self, rows: np.ndarray, ends: np.ndarray, req_ids: list[str]
    ) -> TokenEdits | None:
        """-inf for the last token of every bad word whose other tokens end the output
        so far (a one-token bad word is always banned). Empty edits, not None, while
        some row has bad words, so that the metadata is rebuilt at the next step."""
        if not self.bad_words:
            return None
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        any_row = False
        for i, req_id in enumerate(req_ids):
            sequences = self.bad_words.get(req_id)
            if not sequences:
                continue
            any_row = True
            row = int(rows[i])
            start, end = int(self.num_prompt_tokens[row]), int(ends[i])
            for sequence in sequences:
                prefix = len(sequence) - 1
                if prefix == 0 or (
                    prefix <= end - start
                    and self.token_ids[row, end - prefix : end].tolist() == sequence[:-1]
                ):
                    ban_rows.append(i)
                    ban_tokens.append(sequence[-1])
        if not any_row:
            return None
        return TokenEdits(
            rows=torch.tensor(ban_rows, dtype=torch.int64, device=self.device),
            token_ids=torch.tensor(ban_tokens, dtype=torch.int64, device=self.device),
            values=torch.full((len(ban_rows),), float("-inf"), device=self.device),
        )

    def _logit_bias(self, req_ids: list[str], vocab_size: int) -> TokenEdits | None:
        if not self.logit_bias:
            return None
        entries = [
            (i, token, bias)
            for i, req_id in enumerate(req_ids)
            for token, bias in self.logit_bias.get(req_id, {}).items()
            if 0 <= token < vocab_size
        ]
        if not entries:
            return None
        rows_, tokens, values = zip(*entries, strict=True)
        return TokenEdits(
            rows=torch.tensor(rows_, dtype=torch.int64, device=self.device),
            token_ids=torch.tensor(tokens, dtype=torch.int64, device=self.device),
            values=torch.tensor(values, dtype=torch.float32, device=self.device),
        )
