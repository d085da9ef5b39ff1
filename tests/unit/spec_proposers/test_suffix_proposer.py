"""The `suffix` proposer: the longest earlier occurrence of the request's tail votes on
what follows, in this request and in earlier ones; the draft is as long as the votes
stay confident."""

from __future__ import annotations

from plugserve.interfaces.speculative import DraftRequest, SpecProposer
from plugserve_plugins.spec_proposers.suffix import SuffixOptions, SuffixProposer


def proposer(**options: float) -> SuffixProposer:
    return SuffixProposer(num_tokens=6, vocab_size=100, options=SuffixOptions(**options))


def ask(p: SuffixProposer, tokens: list[int], request_id: str = "r", limit: int = 6) -> list[int]:
    return p.propose([DraftRequest(request_id, tokens, 1, limit)])[0]


def test_it_is_a_spec_proposer() -> None:
    assert isinstance(proposer(), SpecProposer)


def test_a_unanimous_match_proposes_up_to_the_limit() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    assert ask(proposer(), tokens) == [4, 5, 6, 7, 8, 9]
    assert ask(proposer(), tokens, limit=2) == [4, 5]


def test_contested_votes_shorten_the_draft() -> None:
    # Only "1 2" of the tail occurred before. After it came 3 twice and 4 once: 3 with
    # confidence 2/3; after "1 2 3", 5 and 6 once each: 1/2 more, 1/3 in all; from there
    # one occurrence, unanimous.
    tokens = [1, 2, 3, 5, 9, 1, 2, 3, 6, 8, 1, 2, 4, 7, 1, 2]
    assert ask(proposer(min_confidence=0.4), tokens) == [3]
    assert ask(proposer(min_confidence=0.3), tokens) == [3, 5, 9, 1, 2, 3]
    assert ask(proposer(min_confidence=0.9), tokens) == []


def test_nothing_seen_before_proposes_nothing() -> None:
    assert ask(proposer(), [1, 2, 3, 4]) == []


def test_finished_requests_are_matched_by_later_ones_while_cached() -> None:
    p = proposer(cache_requests=1)
    ask(p, [10, 11, 12, 13, 14, 15], "first")
    p.request_finished("first")
    assert ask(p, [7, 10, 11], "second") == [12, 13, 14, 15]
    p.request_finished("second")  # evicts "first" from the cache of one
    assert ask(p, [8, 12, 13], "third") == []
    alone = proposer(cache_requests=0)
    ask(alone, [10, 11, 12, 13], "first")
    alone.request_finished("first")
    assert ask(alone, [10, 11], "second") == []


def test_the_request_grows_step_by_step() -> None:
    p = proposer()
    tokens = [5, 6, 7, 8, 9]
    assert ask(p, tokens) == []
    tokens += [5, 6]
    assert ask(p, tokens) == [7, 8, 9, 5, 6]
