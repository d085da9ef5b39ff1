"""The scheduler's side of speculative decoding: asking the proposer for drafts, fitting
them to the request (its length limits and its grammar) and counting what was accepted.

Only a request that is decoding (one known token left to compute) is speculated for;
its drafts are scheduled right after that token, so one pass verifies them all. What the
runner returns is the accepted drafts plus one token of the target's own; the rejected
drafts' KV slots are given back by moving `num_computed_tokens` back over them (their
cache entries are then overwritten by the next pass), and the blocks that held only
rejected positions go back to the pool at once, where the allocator can free a
request's last blocks (capabilities.FreesBlocksPastTokens).

A proposer that runs in the worker (capabilities.ProposesInWorker) is never built here:
its drafts come back with each step's runner output, and `ReturnedDrafts` hands them to
the next `schedule()` as an engine-side proposer would. Each request scheduled to the end
of its tokens is then given `num_tokens` KV slots more than it computes (`lookahead`),
where the worker's proposer writes its guesses' entries right after sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from plugserve.capabilities import (
    frees_blocks_past_tokens,
    proposes_in_worker,
    supports_grammar_rollback,
)
from plugserve.config import StackConfig
from plugserve.datatypes import ModelRunnerOutput, Request
from plugserve.interfaces.kv_cache import KVAllocator
from plugserve.interfaces.speculative import DraftRequest, SpecProposer
from plugserve.interfaces.structured_output import Grammar
from plugserve.messages import SchedulerStats
from plugserve.plugins import PluginRegistry


@dataclass
class SpecDecodeStats:
    """Counters since the engine started, as vLLM's spec_decode metrics count them: a
    draft is one request's proposal verified in one pass."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts whose token at position i was accepted.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1


class ReturnedDrafts:
    """The engine's SpecProposer for a proposer that runs in the worker: the drafts the
    last step's runner output carried, by request."""

    def __init__(self) -> None:
        self._drafts: dict[str, list[int]] = {}

    def received(self, drafts: dict[str, list[int]]) -> None:
        # Only the last step's: a request that sampled nothing in it has none now.
        self._drafts = drafts

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._drafts.get(r.request_id, [])[: r.max_num_tokens] for r in requests]

    def request_finished(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)


class Speculation:
    def __init__(
        self,
        proposer: SpecProposer,
        num_tokens: int,
        max_model_len: int,
        *,
        returned: ReturnedDrafts | None = None,
    ) -> None:
        """`returned`: the proposer runs in the worker and `proposer` is this, which
        receives its drafts."""
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()
        self._returned = returned

    @classmethod
    def from_config(
        cls, config: StackConfig, registry: PluginRegistry, *, vocab_size: int, max_model_len: int
    ) -> Speculation | None:
        """The stack's speculation, None while `stack.speculative` is unset."""
        speculative = config.stack.speculative
        if speculative is None:
            return None
        name = speculative.proposer
        if proposes_in_worker(registry.get("spec_proposer", name)):
            returned = ReturnedDrafts()
            return cls(returned, speculative.num_tokens, max_model_len, returned=returned)
        proposer = registry.build(
            "spec_proposer",
            name,
            config.plugin_options(name),
            num_tokens=speculative.num_tokens,
            vocab_size=vocab_size,
        )
        return cls(proposer, speculative.num_tokens, max_model_len)

    def received(self, runner_output: ModelRunnerOutput) -> None:
        """A step's output is in: the drafts a worker-side proposer sent with it."""
        if self._returned is not None:
            self._returned.received(runner_output.draft_token_ids)

    def lookahead(self, request: Request, end: int) -> int:
        """KV slots to allocate past a request's scheduled tokens (which end at position
        `end`) for a worker-side proposer's writes: `num_tokens` when the step reaches the
        end of the request's tokens (it samples, then the proposer guesses), none past
        the context's end."""
        if self._returned is None or end < request.num_tokens:
            return 0
        return max(0, min(self.num_tokens, self.max_model_len - end))

    def propose(self, requests: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for the decoding requests among `requests`, each cut to what the request
        can still use and to the longest prefix its grammar allows; requests with no
        draft are left out."""
        asked: list[DraftRequest] = []
        eligible: list[Request] = []
        for request in requests:
            limit = self._room(request)
            if limit > 0:
                eligible.append(request)
                asked.append(
                    DraftRequest(
                        request_id=request.request_id,
                        token_ids=request.all_token_ids,
                        num_prompt_tokens=request.num_prompt_tokens,
                        max_num_tokens=limit,
                    )
                )
        if not asked:
            return {}
        proposals = self.proposer.propose(asked)
        drafts: dict[str, list[int]] = {}
        for request, proposal in zip(eligible, proposals, strict=True):
            draft = [int(t) for t in proposal[: self._room(request)]]
            if draft and request.grammar is not None:
                draft = _grammar_allowed_prefix(request.grammar, draft)
            if draft:
                drafts[request.request_id] = draft
        return drafts

    def _room(self, request: Request) -> int:
        """How many drafts the request can use now: 0 unless it is generating and
        decoding; never more than its output or the context can still take beside the
        pass's own token; none with a grammar that cannot undo tokens, while the thinking
        budget forces tokens, or while a reasoning runs that a grammar or a budget
        follows."""
        if request.num_tokens - request.num_computed_tokens != 1 or request.forced_token_ids:
            return 0
        if request.pooling_params is not None:  # it samples nothing
            return 0
        if request.grammar is not None and not supports_grammar_rollback(request.grammar):
            return 0
        reasoning = request.sampling_params.reasoning
        # Where the reasoning ends within a draft, its grammar (or the thinking budget's
        # forced end marker) would have to apply from that token on.
        if (
            request.in_reasoning
            and reasoning is not None
            and (request.grammar is not None or reasoning.budget is not None)
        ):
            return 0
        room = min(self.num_tokens, self.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return max(room, 0)

    def accepted(self, request: Request, draft: list[int], num_sampled: int) -> int:
        """Record a verified draft; returns how many of its tokens were rejected (the KV
        slots to give back)."""
        num_accepted = num_sampled - 1
        self.stats.record(len(draft), num_accepted)
        return len(draft) - num_accepted

    def free_unused_blocks(self, request: Request, kv: KVAllocator) -> None:
        """After a step: the request's blocks past its tokens held only rejected drafts or
        a worker-side proposer's scratch entries; they go back to the pool."""
        if frees_blocks_past_tokens(kv):
            kv.free_blocks_past(request, request.num_tokens)

    def request_finished(self, request_id: str) -> None:
        self.proposer.request_finished(request_id)


def _grammar_allowed_prefix(grammar: Grammar, draft: list[int]) -> list[int]:
    """The longest prefix of `draft` the grammar accepts, token by token; the grammar is
    left as it was."""
    assert supports_grammar_rollback(grammar)
    accepted = 0
    for token in draft:
        if grammar.is_terminated() or not grammar.accept_token(token):
            break
        accepted += 1
    grammar.rollback(accepted)
    return draft[:accepted]


def describe_acceptance(now: SchedulerStats, before: SchedulerStats) -> str | None:
    """The engine log's speculative-decoding line for the interval between two stats
    (None when nothing was verified in it): the share of draft tokens accepted, the mean
    number of tokens a verified draft landed (its accepted tokens plus the target's own),
    and the acceptance rate at each draft position."""
    drafts = now.spec_num_drafts - before.spec_num_drafts
    if drafts <= 0:
        return None
    drafted = now.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = now.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    before_pos = before.spec_num_accepted_tokens_per_pos
    per_pos = [
        (n - (before_pos[i] if i < len(before_pos) else 0)) / drafts
        for i, n in enumerate(now.spec_num_accepted_tokens_per_pos)
    ]
    return (
        f"Speculative decoding: acceptance rate: {100 * accepted / max(drafted, 1):.1f}%, "
        f"mean accepted length: {1 + accepted / drafts:.2f}, drafts: {drafts}, "
        f"per-position acceptance rate: {', '.join(f'{r:.2f}' for r in per_pos)}"
    )
