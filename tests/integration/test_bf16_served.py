"""The configuration the benchmarks serve, end to end: bfloat16 in an engine process on all
its threads (one-row steps shared with the matmuls' helper thread, exponent-coded weights
where the CPU runs cpu_gemm.cpp), behind the HTTP server. Its answers agree with Hugging
Face bf16 by tests/correctness/agreement.py's criterion, for the offline bf16 test's prompts
sent together (batched steps) and one at a time (one-row steps).

Through the zmq transport alone: a transport moves the frames the engine wrote, whatever
dtype computed them, and bf16 through shm is served by the matrix's bf16 cells
(tests/matrix/test_matrix.py), held to the same criterion."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from correctness.agreement import Reference, assert_agrees, clear_first_tokens
from correctness.conftest import BF16_NEW_TOKENS, mixed_prompt_ids

from integration.conftest import (
    MAX_MODEL_LEN,
    greedy_completion,
    require_bundled_transport,
    running_server,
)
from plugserve.bench.plugserve_server import PlugserveServer
from plugserve_plugins.cpu_bf16 import packed_linear
from plugserve_plugins.cpu_bf16.kernel_plan import TILED
from tests.kernel_support import pinned_plan

# The offline bf16 test's prompts and length (tests/correctness/test_bf16_matches_hf.py):
# token ids of 10-400 tokens (prefills of several hundred among them), and references
# that the session has then computed already.
MAX_TOKENS = BF16_NEW_TOKENS
SETTINGS = [
    "--dtype", "bfloat16",
    "--kv-cache-memory", "64MiB",
    "--max-num-seqs", "16",
    "--max-model-len", str(MAX_MODEL_LEN),
]  # fmt: skip


@pytest.fixture(scope="module")
def prompts_and_references(smollm2_path, hf_greedy_references) -> tuple[list, list[Reference]]:
    """The prompts whose first token Hugging Face's bf16 scores prefer clearly here, and
    their references (as in test_bf16_matches_hf.py: at most two of eight left out)."""
    from transformers import AutoTokenizer

    ids = mixed_prompt_ids(AutoTokenizer.from_pretrained(smollm2_path))
    references = hf_greedy_references(ids, MAX_TOKENS, torch.bfloat16)
    clear = clear_first_tokens(references)
    assert sum(clear) >= len(ids) - 2, [len(p) for p in ids]
    kept = [(p, r) for p, r, ok in zip(ids, references, clear, strict=True) if ok]
    return [p for p, _ in kept], [r for _, r in kept]


@pytest.fixture(scope="module")
def prompts(prompts_and_references) -> list[list[int]]:
    return prompts_and_references[0]


@pytest.fixture(scope="module")
def hf_bf16(prompts_and_references) -> list[Reference]:
    return prompts_and_references[1]


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory) -> Iterator[PlugserveServer]:
    # No --num-threads: the engine takes every core, as served, so one-row steps can share
    # their work with the helper thread.
    require_bundled_transport("zmq")
    log_dir = tmp_path_factory.mktemp("bf16-zmq")
    with running_server("zmq", log_dir, settings=SETTINGS) as server:
        yield server


@pytest.mark.starts_server(transport="zmq", settings=SETTINGS)
def test_the_engine_runs_the_served_bf16_path(bf16_server: PlugserveServer) -> None:
    log = bf16_server.log_text()
    if packed_linear.packing_supported(torch.bfloat16, torch.device("cpu")):
        # The suite's pinned plan (tests/conftest.py), followed as set, not measured.
        plan = pinned_plan()
        assert f"bf16 linears: {plan.describe()} (unmeasured: set" in log, log
        if plan.by_bucket[0].library == "own" and plan.by_bucket[0].one_row_mode != TILED:
            assert "one-row cpu_gemm steps shared with the helper thread" in log, log
    else:
        assert "bf16 linears: as the model runs them" in log, log
    assert "dtype torch.bfloat16" in log or "dtype bfloat16" in log, log


async def _complete(server: PlugserveServer, prompts: list, together: bool) -> list:
    """Every prompt's greedy completion; every other one streamed."""
    async with server.async_openai_client() as client:
        answers = [
            greedy_completion(client, p, MAX_TOKENS, stream=bool(i % 2))
            for i, p in enumerate(prompts)
        ]
        if together:
            return list(await asyncio.gather(*answers))
        return [await answer for answer in answers]


@pytest.mark.parametrize("together", [True, False], ids=["together", "one-at-a-time"])
def test_served_bf16_agrees_with_hf_bf16(
    bf16_server: PlugserveServer, prompts, hf_bf16, together: bool
) -> None:
    steps_before = bf16_server.metrics()["engine_steps_total"]
    answers = asyncio.run(_complete(bf16_server, prompts, together))
    for prompt, reference, answer in zip(prompts, hf_bf16, answers, strict=True):
        label = f"{len(prompt)}-token prompt"
        assert_agrees(label, reference, answer.token_ids, answer.logprobs)
    steps = bf16_server.wait_idle()["engine_steps_total"] - steps_before
    # One at a time, every decode step is a one-row step (the coded, helper-shared path).
    if not together:
        assert steps >= len(prompts) * (MAX_TOKENS - 1)
