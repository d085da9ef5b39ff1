"""Every registered combination of scheduler × transport × executor × attention backend,
in each dtype the attention backend computes in, that can run on this machine serves one
shared scenario through the real server. An fp32 cell's greedy output equals the Hugging
Face reference token for token (so every other fp32 cell's); a bf16 cell agrees with
Hugging Face bf16 by tests/correctness/agreement.py's criterion.

The cells come from the plugin registry: a newly installed plugin joins with no edit
here. A component that cannot run on this machine says why through an optional
`unavailable_reason()` classmethod (interfaces.ReportsUnavailability), and its cells are
skipped with that reason. An attention backend that computes only in some dtypes lists
them in an optional `dtypes` class attribute (interfaces.HasDtypes, torch dtype names);
the others get float32 and bfloat16 cells.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import pytest
import torch
from correctness.agreement import Reference, assert_agrees, assert_clear_first_tokens
from integration.conftest import GreedyCompletion, greedy_completion, running_server

from plugserve.capabilities import has_dtypes, has_tensor_parallel_limit, reports_unavailability
from plugserve.plugins import get_registry

SLOTS = ("scheduler", "transport", "executor", "attention")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village, there lived an old clockmaker who",
    "Photosynthesis is the process by which",
]
MAX_TOKENS = 16
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Cell:
    scheduler: str
    transport: str
    executor: str
    attention: str
    tensor_parallel_size: int
    dtype: str

    @property
    def id(self) -> str:
        return (
            f"{self.scheduler}-{self.transport}-{self.executor}{self.tensor_parallel_size}"
            f"-{self.attention}-{self.dtype}"
        )

    def settings(self) -> list[str]:
        return [
            "--stack.scheduler", self.scheduler,
            "--stack.executor", self.executor,
            "--stack.attention", self.attention,
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--max-num-seqs", "8",
            "--kv-cache-memory", "32MiB",
            "--max-model-len", "512",
            "--dtype", self.dtype,
        ]  # fmt: skip


def matrix_cells() -> list:
    registry = get_registry()
    impls = {slot: registry.implementations(slot) for slot in SLOTS}
    params = []
    for names in itertools.product(*(impls[slot] for slot in SLOTS)):
        chosen = dict(zip(SLOTS, names, strict=True))
        executor_cls = impls["executor"][chosen["executor"]].cls
        # An executor that spans processes is exercised with two ranks.
        tp = 2
        if has_tensor_parallel_limit(executor_cls):
            tp = min(tp, executor_cls.max_tensor_parallel_size or tp)
        reasons = [
            reason
            for slot in SLOTS
            if (reason := _unavailable(impls[slot][chosen[slot]].cls)) is not None
        ]
        marks = [pytest.mark.skip(reason="; ".join(reasons))] if reasons else []
        attention_cls = impls["attention"][chosen["attention"]].cls
        # A backend's own dtypes, of those the matrix has references for.
        own_dtypes = attention_cls.dtypes if has_dtypes(attention_cls) else DTYPES
        for dtype in [d for d in DTYPES if d in own_dtypes]:
            cell = Cell(tensor_parallel_size=tp, dtype=dtype, **chosen)
            params.append(pytest.param(cell, id=cell.id, marks=marks))
    return params


def _unavailable(cls: type) -> str | None:
    return cls.unavailable_reason() if reports_unavailability(cls) else None


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_fp32(prompt_ids, hf_greedy_generate, tokenizer) -> list[GreedyCompletion]:
    """Greedy tokens and text from Hugging Face transformers `generate`, fp32, prompt by
    prompt (no logprobs: fp32 cells are compared token for token)."""
    ids = hf_greedy_generate(prompt_ids, MAX_TOKENS)
    return [GreedyCompletion(tokenizer.decode(t, skip_special_tokens=True), t, []) for t in ids]


@pytest.fixture(scope="module")
def hf_bf16(prompt_ids, hf_greedy_references) -> list[Reference]:
    references = hf_greedy_references(prompt_ids, MAX_TOKENS, torch.bfloat16)
    assert_clear_first_tokens(references, PROMPTS)
    return references


async def _scenario(server) -> list[GreedyCompletion]:
    """Half the prompts streamed, half not, all at once; each token with its logprob."""
    async with server.async_openai_client() as client:
        answers = (
            greedy_completion(client, p, MAX_TOKENS, stream=bool(i % 2))
            for i, p in enumerate(PROMPTS)
        )
        return list(await asyncio.gather(*answers))


@pytest.mark.parametrize("cell", matrix_cells())
def test_cell_matches_hf(cell: Cell, request: pytest.FixtureRequest, tmp_path) -> None:
    with running_server(cell.transport, tmp_path, settings=cell.settings()) as server:
        completions = asyncio.run(_scenario(server))
        idle = server.wait_idle()
    if cell.dtype == "float32":
        expected = request.getfixturevalue("hf_fp32")
        assert [c.token_ids for c in completions] == [e.token_ids for e in expected]
        assert [c.text for c in completions] == [e.text for e in expected]
    else:
        references = request.getfixturevalue("hf_bf16")
        for prompt, reference, c in zip(PROMPTS, references, completions, strict=True):
            assert_agrees(repr(prompt), reference, c.token_ids, c.logprobs)
    assert idle["kv_cache_usage"] == 0 and idle["num_requests_running"] == 0
