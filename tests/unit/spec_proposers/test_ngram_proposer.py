"""The `ngram` proposer: prompt lookup over the request's own tokens."""

from __future__ import annotations

import pytest

from plugserve.config import load_config
from plugserve.interfaces.speculative import DraftRequest, SpecProposer
from plugserve.plugins import get_registry
from plugserve_plugins.spec_proposers.ngram import NgramOptions, NgramProposer


def propose(tokens: list[int], max_num_tokens: int = 4, **options: int) -> list[int]:
    proposer = NgramProposer(num_tokens=4, vocab_size=100, options=NgramOptions(**options))
    request = DraftRequest("r", tokens, num_prompt_tokens=1, max_num_tokens=max_num_tokens)
    return proposer.propose([request])[0]


def test_it_is_registered_and_a_spec_proposer() -> None:
    assert get_registry().get("spec_proposer", "ngram") is NgramProposer
    assert isinstance(NgramProposer(num_tokens=2, vocab_size=10), SpecProposer)


def test_proposes_what_followed_the_tail_earlier() -> None:
    #          the tail 7 8 9 occurred here, followed by 1 2 3 4 5
    tokens = [5, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert propose(tokens) == [1, 2, 3, 4]
    assert propose(tokens, max_num_tokens=2) == [1, 2]


def test_the_longest_match_wins_then_the_latest() -> None:
    # "9" alone last occurred before 40, but "8 9" occurred before 30.
    tokens = [8, 9, 30, 31, 1, 9, 40, 41, 2, 8, 9]
    assert propose(tokens, min_n=1, max_n=3) == [30, 31, 1, 9]
    # Only one-token matches allowed: the latest "9" wins.
    assert propose(tokens, min_n=1, max_n=1) == [40, 41, 2, 8]


def test_no_match_of_min_n_tokens_proposes_nothing() -> None:
    assert propose([1, 2, 3, 4, 5, 6]) == []
    # "6" occurred, but not "5 6", and two tokens are required.
    assert propose([6, 1, 2, 5, 6], min_n=2) == []
    assert propose([6, 1, 2, 5, 6], min_n=1) == [1, 2, 5, 6]


def test_a_repeating_run_is_continued_with_its_period() -> None:
    assert propose([3, 1, 2, 1, 2, 1, 2], min_n=2) == [1, 2, 1, 2]
    assert propose([4, 4, 4], min_n=1) == [4, 4, 4, 4]


def test_options_are_checked_with_the_stack() -> None:
    settings = {"speculative": {"proposer": "ngram"}}
    load_config(None, {**settings, "plugins.ngram": {"min_n": 1, "max_n": 2}})
    with pytest.raises(ValueError, match="min_n"):
        load_config(None, {**settings, "plugins.ngram": {"min_n": 3, "max_n": 2}})
    with pytest.raises(ValueError, match="nope"):
        load_config(None, {"speculative": {"proposer": "nope"}})
