"""The `draft_model` proposer's place and settings (its drafts, verified end to end:
tests/correctness/test_speculative_matches_hf.py)."""

from __future__ import annotations

import pytest

from plugserve.capabilities import proposes_in_worker
from plugserve.config import load_config
from plugserve.plugins import get_registry
from plugserve_plugins.spec_proposers.draft_model import DraftModelOptions, DraftModelProposer


def test_it_is_registered_and_proposes_in_the_worker() -> None:
    assert get_registry().get("spec_proposer", "draft_model") is DraftModelProposer
    assert proposes_in_worker(DraftModelProposer)


def test_its_draft_is_the_embedded_model_unless_named() -> None:
    assert DraftModelProposer(num_tokens=3, vocab_size=10).proposer_model() == (
        "smollm2-135m-instruct"
    )
    named = DraftModelProposer(
        num_tokens=3, vocab_size=10, options=DraftModelOptions(model="/models/draft")
    )
    assert named.proposer_model() == "/models/draft"


def test_its_options_are_checked_with_the_stack() -> None:
    settings = {"speculative": {"proposer": "draft_model", "num_tokens": 3}}
    config = load_config(None, {**settings, "plugins.draft_model": {"model": "/models/draft"}})
    assert config.plugin_options("draft_model") == {"model": "/models/draft"}
    with pytest.raises(ValueError, match="draft"):
        load_config(None, {**settings, "plugins.draft_model": {"draft": "/models/draft"}})
