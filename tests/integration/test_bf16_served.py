"""The configuration the benchmarks serve, end to end: bfloat16 in an engine process on all
its threads (one-row steps shared with the matmuls' helper thread, exponent-coded weights
where the CPU runs cpu_gemm.cpp), behind the HTTP server, on both transports. Its answers
agree with Hugging Face bf16 by tests/correctness/agreement.py's criterion, for prompts
sent together (batched steps) and one at a time (one-row steps)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from correctness.agreement import Reference, assert_agrees, assert_clear_first_tokens
from correctness.conftest import CORPUS

from integration.conftest import MAX_MODEL_LEN, ServerProcess, greedy_completion, running_server
from plugserve.worker import cpu_linear
from plugserve.worker.kernel_plan import TILED
from tests.kernel_support import pinned_plan

MAX_TOKENS = 24
TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village, there lived an old clockmaker who",
    "Photosynthesis is the process by which",
    "The three primary colors are",
]
# Two long prompts as token ids (prefills of several hundred tokens): slices of the
# correctness corpus whose first tokens are clear (assert_clear_first_tokens checks).
LONG_PROMPT_SLICES = [(0, 215), (20, 420)]
SETTINGS = [
    "--dtype", "bfloat16",
    "--kv-cache-memory", "64MiB",
    "--max-num-seqs", "16",
    "--max-model-len", str(MAX_MODEL_LEN),
]  # fmt: skip


@pytest.fixture(scope="module")
def prompts(smollm2_path) -> list[str | list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2_path).encode(CORPUS)
    return [*TEXT_PROMPTS, *(ids[start:end] for start, end in LONG_PROMPT_SLICES)]


@pytest.fixture(scope="module")
def hf_bf16(smollm2_path, prompts, hf_greedy_references) -> list[Reference]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    references = hf_greedy_references(ids, MAX_TOKENS, torch.bfloat16)
    assert_clear_first_tokens(references, [p if isinstance(p, str) else len(p) for p in prompts])
    return references


@pytest.fixture(scope="module")
def bf16_server(transport: str, tmp_path_factory) -> Iterator[ServerProcess]:
    # No --num-threads: the engine takes every core, as served, so one-row steps can share
    # their work with the helper thread.
    log_dir = tmp_path_factory.mktemp(f"bf16-{transport}")
    with running_server(transport, log_dir, settings=SETTINGS) as server:
        yield server


def test_the_engine_runs_the_served_bf16_path(bf16_server: ServerProcess) -> None:
    log = bf16_server.log_text()
    if cpu_linear.packing_supported(torch.bfloat16, torch.device("cpu")):
        # The suite's pinned plan (tests/conftest.py), followed as set, not measured.
        plan = pinned_plan()
        assert f"bf16 linears: {plan.describe()} (unmeasured: set" in log, log
        if plan.by_bucket[0].library == "own" and plan.by_bucket[0].one_row_mode != TILED:
            assert "one-row cpu_gemm steps shared with the helper thread" in log, log
    else:
        assert "bf16 linears: as the model runs them" in log, log
    assert "dtype torch.bfloat16" in log or "dtype bfloat16" in log, log


async def _complete(server: ServerProcess, prompts: list, together: bool) -> list:
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
    bf16_server: ServerProcess, prompts, hf_bf16, together: bool
) -> None:
    steps_before = bf16_server.metrics()["engine_steps_total"]
    answers = asyncio.run(_complete(bf16_server, prompts, together))
    for prompt, reference, answer in zip(prompts, hf_bf16, answers, strict=True):
        label = repr(prompt) if isinstance(prompt, str) else f"{len(prompt)}-token prompt"
        assert_agrees(label, reference, answer.token_ids, answer.logprobs)
    steps = bf16_server.wait_idle()["engine_steps_total"] - steps_before
    # One at a time, every decode step is a one-row step (the coded, helper-shared path).
    if not together:
        assert steps >= len(prompts) * (MAX_TOKENS - 1)
