"""An example third-party speculative-decoding proposer, `repeat_run`: when a request's
last `min_run` tokens are one token repeated (padding, a rule of dashes, a model stuck
in a loop), it proposes that the run goes on. Otherwise it proposes nothing, and the
request decodes as it would without speculation.

Selected in stack.yaml:

    stack:
      speculative: {proposer: repeat_run, num_tokens: 4}
    plugins:
      repeat_run: {min_run: 3}
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from plugserve import hookimpl
from plugserve.interfaces.speculative import DraftRequest


class RepeatRunOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_run: int = Field(2, ge=1)  # how long a run must be before it is bet on


class RepeatRunProposer:
    Options = RepeatRunOptions

    def __init__(
        self, *, num_tokens: int, vocab_size: int, options: RepeatRunOptions | None = None
    ) -> None:
        self.num_tokens = num_tokens
        self.min_run = (options or RepeatRunOptions()).min_run

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        proposals = []
        for request in requests:
            tail = list(request.token_ids[-self.min_run :])
            in_a_run = len(tail) == self.min_run and tail.count(tail[-1]) == self.min_run
            count = min(self.num_tokens, request.max_num_tokens) if in_a_run else 0
            proposals.append([tail[-1]] * count)
        return proposals

    def request_finished(self, request_id: str) -> None:
        pass


@hookimpl
def register_spec_proposers(register):
    register("repeat_run", RepeatRunProposer)
