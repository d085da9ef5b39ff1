"""StepInputBuilder: a step's flat inputs from the persistent batch, token by token as
the model runner's contract says, written into buffers reused from step to step."""

from __future__ import annotations

import numpy as np
import torch

from plugserve.datatypes import NewRequestData
from plugserve.sampling_params import SamplingParams
from plugserve.worker.input_batch import InputBatch
from plugserve.worker.step_inputs import StepInputBuilder

BLOCK_SIZE = 4


def make_batch(requests: dict[str, tuple[list[int], list[int], int]]) -> InputBatch:
    """requests: id → (token ids, block ids, tokens already computed)."""
    batch = InputBatch(
        max_num_reqs=8, max_model_len=64, max_blocks_per_req=16, device=torch.device("cpu")
    )
    for req_id, (tokens, blocks, computed) in requests.items():
        batch.add_request(
            NewRequestData(
                req_id=req_id,
                prompt_token_ids=tokens,
                output_token_ids=[],
                sampling_params=SamplingParams(),
                block_ids=blocks,
                num_computed_tokens=computed,
            )
        )
    return batch


def expected(batch: InputBatch, scheduled: dict[str, int]) -> dict[str, list[int]]:
    """The same inputs, one token at a time."""
    out: dict[str, list[int]] = {"ids": [], "positions": [], "slots": [], "last": []}
    for row, req_id in enumerate(batch.req_ids):
        for i in range(scheduled.get(req_id, 0)):
            position = int(batch.num_computed_tokens[row]) + i
            block = int(batch.block_table[row, position // BLOCK_SIZE])
            out["ids"].append(int(batch.token_ids[row, position]))
            out["positions"].append(position)
            out["slots"].append(block * BLOCK_SIZE + position % BLOCK_SIZE)
        if scheduled.get(req_id) and position + 1 == batch.num_tokens[row]:
            out["last"].append(len(out["ids"]) - 1)
    return out


def test_a_mixed_step_lays_out_every_token_of_every_scheduled_row() -> None:
    batch = make_batch(
        {
            "decode": (list(range(100, 107)), [5, 2], 6),  # its 7th token
            "idle": ([1, 2, 3], [7], 3),  # not scheduled this step
            "prefill": (list(range(200, 210)), [9, 1, 4], 0),  # whole prompt
            "chunk": (list(range(300, 312)), [3, 8, 6], 4),  # 4 of 8 left: no sample
        }
    )
    scheduled = {"decode": 1, "prefill": 10, "chunk": 4}
    builder = StepInputBuilder(max_num_tokens=32, max_num_reqs=8, block_size=BLOCK_SIZE)

    step = builder.build(batch, scheduled)

    want = expected(batch, scheduled)
    assert step.input_ids.tolist() == want["ids"]
    assert step.positions.tolist() == want["positions"]
    assert step.attention.slot_mapping.tolist() == want["slots"]
    assert step.attention.query_start_loc.tolist() == [0, 1, 11, 15]
    assert step.attention.seq_lens.tolist() == [7, 10, 8]
    assert step.attention.block_table.tolist() == [[5, 2, 0], [9, 1, 4], [3, 8, 6]]
    assert step.sample_rows.tolist() == [0, 2]  # the chunk stops short of its end
    assert step.logits_indices.tolist() == want["last"] == [0, 10]


def test_buffers_are_reused_and_rewritten_each_step() -> None:
    batch = make_batch({"a": (list(range(10, 22)), [1, 2, 3, 5], 0), "b": ([7, 8], [4], 1)})
    builder = StepInputBuilder(max_num_tokens=16, max_num_reqs=8, block_size=BLOCK_SIZE)

    first = builder.build(batch, {"a": 12, "b": 1})
    first_ids = first.input_ids.ctypes.data
    batch.num_computed_tokens[0] = 12
    batch.append_sampled(np.array([0, 1]), np.array([99, 98]))
    batch.num_computed_tokens[1] = 2
    second = builder.build(batch, {"a": 1, "b": 1})

    assert second.input_ids.ctypes.data == first_ids  # the same memory, rewritten
    assert second.input_ids.tolist() == [99, 98]
    assert second.positions.tolist() == [12, 2]
    assert second.attention.slot_mapping.tolist() == [5 * BLOCK_SIZE + 0, 4 * BLOCK_SIZE + 2]
    assert second.logits_indices.tolist() == [0, 1]


def test_a_step_past_the_token_budget_grows_the_buffers() -> None:
    batch = make_batch({"long": (list(range(40)), list(range(10)), 0)})
    builder = StepInputBuilder(max_num_tokens=8, max_num_reqs=2, block_size=BLOCK_SIZE)
    step = builder.build(batch, {"long": 40})
    assert step.input_ids.tolist() == list(range(40))
    assert step.attention.slot_mapping.tolist() == list(range(40))


def test_a_decode_step_lays_out_one_token_per_scheduled_row() -> None:
    """Every scheduled row computes one token: idle rows left out, a row short of the end
    of its known tokens not sampled."""
    batch = make_batch(
        {
            "a": (list(range(100, 107)), [5, 2], 6),  # its 7th token: samples
            "idle": ([1, 2, 3], [7], 3),
            "b": ([40, 41, 42, 43, 44], [3, 8], 4),  # its 5th token, in the second block
            "behind": (list(range(300, 306)), [6, 1], 2),  # 3rd of 6 known: no sample
        }
    )
    scheduled = {"a": 1, "b": 1, "behind": 1}
    builder = StepInputBuilder(max_num_tokens=32, max_num_reqs=8, block_size=BLOCK_SIZE)

    step = builder.build(batch, scheduled)

    want = expected(batch, scheduled)
    assert step.input_ids.tolist() == want["ids"] == [106, 44, 302]
    assert step.positions.tolist() == want["positions"] == [6, 4, 2]
    assert step.attention.slot_mapping.tolist() == want["slots"]
    assert step.attention.query_start_loc.tolist() == [0, 1, 2, 3]
    assert step.attention.seq_lens.tolist() == [7, 5, 3]
    assert step.attention.block_table.tolist() == [[5, 2], [3, 8], [6, 1]]
    assert step.query_lens.tolist() == [1, 1, 1]
    assert step.sample_rows.tolist() == [0, 2]
    assert step.logits_indices.tolist() == want["last"] == [0, 1]


def test_a_step_of_one_token_for_every_row_lays_out_the_same_inputs() -> None:
    """Every row of the batch scheduled for one token (decode steps, and a one-token
    prompt) takes the builder's shorter path, to the same layout; one row there is behind
    the end of its known tokens and does not sample."""
    batch = make_batch(
        {
            "a": (list(range(100, 107)), [5, 2], 6),  # its 7th token: samples
            "b": ([40, 41, 42, 43, 44], [3, 8], 4),  # its 5th token, opening its second block
            "behind": (list(range(300, 306)), [6, 1], 2),  # 3rd of 6 known: no sample
            "prompt": ([77], [9], 0),  # a one-token prompt
        }
    )
    scheduled = {"a": 1, "b": 1, "behind": 1, "prompt": 1}
    builder = StepInputBuilder(max_num_tokens=32, max_num_reqs=8, block_size=BLOCK_SIZE)

    step = builder.build(batch, scheduled)

    want = expected(batch, scheduled)
    assert step.input_ids.tolist() == want["ids"] == [106, 44, 302, 77]
    assert step.positions.tolist() == want["positions"] == [6, 4, 2, 0]
    assert step.attention.slot_mapping.tolist() == want["slots"]
    assert step.attention.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert step.attention.seq_lens.tolist() == [7, 5, 3, 1]
    assert step.attention.block_table.tolist() == [[5, 2], [3, 8], [6, 1], [9, 0]]
    assert step.query_lens.tolist() == [1, 1, 1, 1]
    assert step.sample_rows.tolist() == [0, 1, 3]
    assert step.logits_indices.tolist() == want["last"] == [0, 1, 3]

    # Next step: every row samples; the sampled rows are a fresh array each step.
    batch.num_computed_tokens[:4] += 1
    batch.num_computed_tokens[2] = 6  # caught up with its known tokens
    batch.append_sampled(np.array([0, 1, 2, 3]), np.array([7, 8, 9, 10]))
    batch.append_blocks(0, [4])
    nxt = builder.build(batch, scheduled)
    want = expected(batch, scheduled)
    assert nxt.input_ids.tolist() == want["ids"] == [7, 8, 9, 10]
    assert nxt.attention.slot_mapping.tolist() == want["slots"]
    assert nxt.attention.block_table.tolist() == [[5, 2, 4], [3, 8, 0], [6, 1, 0], [9, 0, 0]]
    assert nxt.sample_rows.tolist() == [0, 1, 2, 3]
    assert step.sample_rows.tolist() == [0, 1, 3]
