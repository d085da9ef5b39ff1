"""stack.linear_method int8 (W8A8) served end to end, selected on the command line: the
engine quantizes every linear and runs the whole layer stack over the W8A8 kernels' C++
calls (its start-up log says both), and a prompt's greedy completion, streamed, is the
offline engine's for the same prompt token for token: the same kernels on the same rows,
each row's activations quantized alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from integration.conftest import (
    MAX_MODEL_LEN,
    MODEL,
    greedy_completion,
    require_bundled_transport,
    running_server,
)
from plugserve import LLM, SamplingParams
from plugserve.bench.plugserve_server import PlugserveServer
from plugserve_plugins.linear_methods import w8a8_plan
from tests.kernel_support import missing_cpu_flags

MISSING = missing_cpu_flags(w8a8_plan.REQUIRED_CPU_FLAGS)
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"the W8A8 kernel needs a CPU with {' and '.join(MISSING)}"
)
SETTINGS = [
    "--dtype", "bfloat16",
    "--stack.linear_method", "int8",
    "--kv-cache-memory", "64MiB",
    "--max-num-seqs", "4",
    "--max-model-len", str(MAX_MODEL_LEN),
]  # fmt: skip
PROMPT = "The three laws of motion state that"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory) -> Iterator[PlugserveServer]:
    require_bundled_transport("zmq")
    log_dir = tmp_path_factory.mktemp("int8-zmq")
    with running_server("zmq", log_dir, settings=SETTINGS) as server:
        yield server


@pytest.mark.starts_server(transport="zmq", settings=SETTINGS)
def test_served_int8_runs_w8a8_and_answers_as_the_offline_engine(
    int8_server: PlugserveServer,
) -> None:
    log = int8_server.log_text()
    assert "int8 weights and per-token int8 activations (W8A8)" in log, log
    assert "the whole stack as one op (cpu_decoder.cpp) at 1, 2-8, 9-64, 65-256, 257+" in log, log

    llm = LLM(model=MODEL, dtype="bfloat16", linear_method="int8", kv_cache_memory="32MiB")
    try:
        ids = llm.tokenizer.encode(PROMPT)
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        [offline] = llm.generate({"prompt_token_ids": ids}, params)
    finally:
        llm.engine.shutdown()

    async def served() -> list[int]:
        async with int8_server.async_openai_client() as client:
            answer = await greedy_completion(client, ids, NEW_TOKENS, stream=True)
            return list(answer.token_ids)

    assert asyncio.run(served()) == list(offline.outputs[0].token_ids)
