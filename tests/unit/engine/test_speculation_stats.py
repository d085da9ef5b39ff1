"""Speculative decoding's counters: how the engine counts verified drafts, how they
cross to the API servers as increments (per draft position too), and the engine log's
line about them."""

from __future__ import annotations

from plugserve.engine.speculation import SpecDecodeStats, describe_acceptance
from plugserve.messages import SchedulerStats, add_stats, stats_since


def test_a_draft_counts_its_tokens_and_each_accepted_position() -> None:
    stats = SpecDecodeStats()
    stats.record(num_draft_tokens=3, num_accepted=2)
    stats.record(num_draft_tokens=4, num_accepted=0)
    stats.record(num_draft_tokens=2, num_accepted=2)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 0, 0]


def test_per_position_counts_travel_as_increments_and_add_up() -> None:
    before = SchedulerStats(spec_num_drafts=2, spec_num_accepted_tokens_per_pos=[2, 1])
    now = SchedulerStats(spec_num_drafts=5, spec_num_accepted_tokens_per_pos=[4, 2, 1])
    delta = stats_since(now, before)
    assert delta.spec_num_drafts == 3
    assert delta.spec_num_accepted_tokens_per_pos == [2, 1, 1]
    total = SchedulerStats()
    add_stats(total, stats_since(before, SchedulerStats()))
    add_stats(total, delta)
    assert total.spec_num_accepted_tokens_per_pos == [4, 2, 1]
    assert total.spec_num_drafts == 5


def test_the_log_line_gives_acceptance_rate_and_mean_accepted_length() -> None:
    before = SchedulerStats(spec_num_drafts=10, spec_num_draft_tokens=30)
    assert describe_acceptance(before, before) is None  # nothing verified since
    now = SchedulerStats(
        spec_num_drafts=14,
        spec_num_draft_tokens=42,
        spec_num_accepted_tokens=6,
        spec_num_accepted_tokens_per_pos=[3, 2, 1],
    )
    line = describe_acceptance(now, before)
    assert line == (
        "Speculative decoding: acceptance rate: 50.0%, mean accepted length: 2.50, "
        "drafts: 4, per-position acceptance rate: 0.75, 0.50, 0.25"
    )
