"""Speculative decoding's KV blocks, scheduler side: a request is allocated blocks for
its drafts (and, with a proposer that runs in the worker, for the proposer's writes past
them), and right after verification the blocks that held only rejected positions go back
to the pool, ready to be taken again first.

The scheduler runs with the real paged allocator; the tests play the model runner's part
by returning the tokens a verification would.
"""

from __future__ import annotations

from collections.abc import Sequence

from plugserve.datatypes import ModelRunnerOutput, Request, SchedulerOutput
from plugserve.engine.scheduler import Scheduler
from plugserve.engine.speculation import ReturnedDrafts, Speculation
from plugserve.interfaces.speculative import DraftRequest
from plugserve.plugins import get_registry
from plugserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 32
MAX_MODEL_LEN = 256
DRAFT_TOKEN = 5


class SameTokenProposer:
    """An engine-side proposer that always bets on DRAFT_TOKEN, as many as allowed."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [[DRAFT_TOKEN] * r.max_num_tokens for r in requests]

    def request_finished(self, request_id: str) -> None:
        pass


def make_scheduler(speculation: Speculation) -> Scheduler:
    registry = get_registry()
    return Scheduler(
        policy=registry.build("scheduler", "fcfs"),
        kv_allocator=registry.build(
            "kv_allocator",
            "paged",
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=True,
        ),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=MAX_MODEL_LEN,
        speculation=speculation,
    )


def add_request(scheduler: Scheduler, prompt_len: int) -> Request:
    request = Request("a", list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=20), 2)
    scheduler.add_request(request)
    return request


def close_step(
    scheduler: Scheduler, out: SchedulerOutput, tokens: list[int], drafts: list[int] | None = None
) -> None:
    """The runner's answer for request "a": `tokens` (accepted drafts, then its own), and
    the drafts a worker-side proposer guessed after them; handed over as the engine does."""
    output = ModelRunnerOutput(
        sampled_token_ids={"a": tokens}, draft_token_ids={"a": drafts} if drafts else {}
    )
    assert scheduler.speculation is not None
    scheduler.speculation.received(output)
    scheduler.update_from_output(out, output)


def held_blocks(scheduler: Scheduler) -> list[int]:
    return scheduler.kv.block_ids("a")


def test_blocks_that_held_only_rejected_drafts_return_to_the_pool_at_once() -> None:
    scheduler = make_scheduler(Speculation(SameTokenProposer(), 6, MAX_MODEL_LEN))
    kv = scheduler.kv
    request = add_request(scheduler, 3)
    close_step(scheduler, scheduler.schedule(), [7])  # the prompt: one block

    out = scheduler.schedule()  # token 7 at position 3, six drafts at 4..9: three blocks
    assert out.scheduled_spec_decode_tokens == {"a": [DRAFT_TOKEN] * 6}
    assert len(held_blocks(scheduler)) == 3
    third = held_blocks(scheduler)[2]
    close_step(scheduler, out, [DRAFT_TOKEN, 8])  # one draft accepted, five rejected

    # Six tokens known, five computed: the third block held only rejected positions.
    assert (request.num_tokens, request.num_computed_tokens) == (6, 5)
    assert len(held_blocks(scheduler)) == 2
    assert kv.num_free_blocks == NUM_BLOCKS - 2
    kv.check_consistency()

    # The next step tells the runner the table shrank before it grew again, and takes the
    # freed block back first.
    out = scheduler.schedule()
    assert out.scheduled_cached_reqs.num_kept_blocks == [2]
    assert out.scheduled_cached_reqs.new_block_ids == [[third]]


def test_a_worker_side_proposer_gets_room_for_its_writes_and_its_drafts_scheduled() -> None:
    returned = ReturnedDrafts()
    scheduler = make_scheduler(Speculation(returned, 3, MAX_MODEL_LEN, returned=returned))
    request = add_request(scheduler, 3)

    out = scheduler.schedule()  # the prompt (0..2) and 3 slots for the proposer (3..5)
    assert len(held_blocks(scheduler)) == 2
    close_step(scheduler, out, [7], drafts=[5, 6, 7])
    # Its writes were scratch: once verified, only the known tokens' block is kept.
    assert len(held_blocks(scheduler)) == 1

    out = scheduler.schedule()  # 7 and the drafts at 3..6, the proposer's slots 7..9
    assert out.scheduled_spec_decode_tokens == {"a": [5, 6, 7]}
    assert out.num_scheduled_tokens == {"a": 4}
    assert len(held_blocks(scheduler)) == 3
    close_step(scheduler, out, [5, 6, 7, 9], drafts=[1, 2, 3])  # all accepted
    assert (request.num_tokens, request.num_computed_tokens) == (8, 7)
    assert len(held_blocks(scheduler)) == 2
    assert scheduler.kv.num_free_blocks == NUM_BLOCKS - 2

    # A step with no drafts for the request leaves it none (they follow the last step).
    close_step(scheduler, scheduler.schedule(), [4])
    assert scheduler.speculation is not None
    assert scheduler.speculation.propose([request]) == {}
