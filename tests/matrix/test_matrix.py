"""Every registered combination of scheduler × transport × executor × attention backend
that can run on this machine serves one shared scenario through the real server, and
every cell's greedy output equals the Hugging Face reference (so every other cell's).

The cells come from the plugin registry: a newly installed plugin joins with no edit
here. A component that cannot run on this machine says why through an optional
`unavailable_reason()` classmethod, and its cells are skipped with that reason.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import pytest
from integration.conftest import running_server

from plugserve.plugins import get_registry

SLOTS = ("scheduler", "transport", "executor", "attention")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village, there lived an old clockmaker who",
    "Photosynthesis is the process by which",
]
MAX_TOKENS = 16


@dataclass(frozen=True)
class Cell:
    scheduler: str
    transport: str
    executor: str
    attention: str
    tensor_parallel_size: int

    @property
    def id(self) -> str:
        return f"{self.scheduler}-{self.transport}-{self.executor}{self.tensor_parallel_size}-{self.attention}"

    def settings(self) -> list[str]:
        return [
            "--stack.scheduler", self.scheduler,
            "--stack.executor", self.executor,
            "--stack.attention", self.attention,
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--max-num-seqs", "8",
            "--kv-cache-memory", "32MiB",
            "--max-model-len", "512",
            "--dtype", "float32",
        ]  # fmt: skip


def matrix_cells() -> list:
    registry = get_registry()
    impls = {slot: registry.implementations(slot) for slot in SLOTS}
    params = []
    for names in itertools.product(*(impls[slot] for slot in SLOTS)):
        chosen = dict(zip(SLOTS, names, strict=True))
        executor_cls = impls["executor"][chosen["executor"]].cls
        # An executor that spans processes is exercised with two ranks.
        tp = min(2, getattr(executor_cls, "max_tensor_parallel_size", None) or 2)
        cell = Cell(tensor_parallel_size=tp, **chosen)
        reasons = [
            reason
            for slot in SLOTS
            if (reason := _unavailable(impls[slot][chosen[slot]].cls)) is not None
        ]
        marks = [pytest.mark.skip(reason="; ".join(reasons))] if reasons else []
        params.append(pytest.param(cell, id=cell.id, marks=marks))
    return params


def _unavailable(cls: type) -> str | None:
    check = getattr(cls, "unavailable_reason", None)
    return check() if callable(check) else None


@pytest.fixture(scope="module")
def hf_reference(smollm2_path, hf_greedy_generate) -> list[str]:
    """Greedy text from Hugging Face transformers `generate`, fp32, prompt by prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    ids = hf_greedy_generate([tokenizer.encode(p) for p in PROMPTS], MAX_TOKENS)
    return [tokenizer.decode(out, skip_special_tokens=True) for out in ids]


async def _scenario(server) -> list[str]:
    """Half the prompts streamed, half not, all at once."""
    async with server.async_openai_client() as client:

        async def one(i: int, prompt: str) -> str:
            kwargs = dict(
                model="smollm2-135m-instruct",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            if i % 2:
                stream = await client.completions.create(stream=True, **kwargs)
                return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
            return (await client.completions.create(**kwargs)).choices[0].text

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


@pytest.mark.parametrize("cell", matrix_cells())
def test_cell_matches_hf(cell: Cell, hf_reference, tmp_path):
    with running_server(cell.transport, tmp_path, settings=cell.settings()) as server:
        texts = asyncio.run(_scenario(server))
        idle = server.wait_idle()
    assert texts == hf_reference
    assert idle["kv_cache_usage"] == 0 and idle["num_requests_running"] == 0
