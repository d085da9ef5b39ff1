"""`ngram`: prompt lookup. The request's last n tokens are looked for earlier in its own
prompt and output; the tokens that followed the match are proposed. Text that copies
from its context (edits, summaries quoting the source, code with small changes) is
guessed well, and a request whose tail occurs nowhere before gets no proposal at all,
so it decodes exactly as it would without speculation.

Among the matches of the last n tokens, min_n <= n <= max_n, the longest wins, and
among equally long ones the latest (the most recent context is the likeliest to be
repeated). A match close to the end (a repeating run) is continued periodically: the
proposal goes on as if the tokens it proposes had been written already."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from plugserve import hookimpl
from plugserve.interfaces.speculative import DraftRequest


class NgramOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_n: int = Field(2, ge=1)  # the shortest tail that may be matched
    max_n: int = Field(5, ge=1)  # the longest tail that is tried

    @model_validator(mode="after")
    def _ordered(self) -> NgramOptions:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self


class NgramProposer:
    Options = NgramOptions

    def __init__(self, *, num_tokens: int, vocab_size: int, options: NgramOptions | None = None):
        self.num_tokens = num_tokens
        self.options = options or NgramOptions()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [
            propose_from_context(
                np.asarray(r.token_ids, dtype=np.int64),
                min(r.max_num_tokens, self.num_tokens),
                self.options.min_n,
                self.options.max_n,
            )
            for r in requests
        ]

    def request_finished(self, request_id: str) -> None:
        pass  # nothing is kept between steps


def propose_from_context(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The up to `num_tokens` tokens that followed the longest (then latest) earlier
    occurrence of the last n tokens of `tokens`, min_n <= n <= max_n; [] if none."""
    length = len(tokens)
    if num_tokens <= 0 or length <= min_n:
        return []
    # Candidates: every earlier position holding the last token (a match ends there).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if not len(ends):
        return []
    # Grow every candidate's match backwards one token at a time, keeping those that
    # still agree; the survivors of the longest round are the longest matches.
    matched = np.ones(len(ends), dtype=bool)
    best_ends, best_n = (ends, 1) if min_n <= 1 else (ends[:0], 0)
    for n in range(2, min(max_n, length - 1) + 1):
        alive = ends >= n - 1
        alive &= matched
        alive[alive] = tokens[ends[alive] - (n - 1)] == tokens[length - n]
        matched = alive
        if not matched.any():
            break
        if n >= min_n:
            best_ends, best_n = ends[matched], n
    if best_n == 0 or not len(best_ends):
        return []
    start = int(best_ends[-1]) + 1
    proposal = tokens[start : start + num_tokens].tolist()
    period = length - start
    while len(proposal) < num_tokens:  # the text goes on repeating with this period
        proposal.append(proposal[len(proposal) - period])
    return proposal


@hookimpl
def register_spec_proposers(register):
    register("ngram", NgramProposer)
