"""Data parallelism: two engine-core processes behind one API server give the same greedy
outputs as one engine, and new requests are spread over both."""

from __future__ import annotations

import asyncio

import pytest

from plugserve.bench.plugserve_server import ENGINE_TITLE
from plugserve.bench.processes import children_of, process_cmdline

from .conftest import COMPLETION_PROMPTS, MAX_TOKENS, SERVER_SETTINGS, running_server

PROMPTS = COMPLETION_PROMPTS * 2


async def _complete_all(server) -> list[str]:
    async with server.async_openai_client() as client:

        async def one(prompt: str) -> str:
            out = await client.completions.create(
                model="smollm2-135m-instruct", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            return out.choices[0].text

        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


TWO_ENGINES = (*SERVER_SETTINGS, "--data-parallel-size", "2")


@pytest.mark.starts_server(settings=TWO_ENGINES)
def test_two_engines_match_one_and_share_the_load(transport, reference, tmp_path):
    with running_server(transport, tmp_path, settings=TWO_ENGINES) as server:
        titles = sorted(
            process_cmdline(pid)
            for pid in children_of(server.pid)
            if ENGINE_TITLE in process_cmdline(pid)
        )
        assert titles == ["plugserve::EngineCore_DP0", "plugserve::EngineCore_DP1"]
        texts = asyncio.run(_complete_all(server))
        metrics = server.wait_idle()
    expected = [out.outputs[0].text for out in reference.completions(PROMPTS)]
    assert texts == expected
    per_engine = [metrics[f'engine_requests_total{{engine="{i}"}}'] for i in range(2)]
    assert sum(per_engine) == len(PROMPTS) and min(per_engine) >= len(PROMPTS) // 4
    assert metrics["kv_cache_usage"] == 0 and metrics["num_requests_running"] == 0
