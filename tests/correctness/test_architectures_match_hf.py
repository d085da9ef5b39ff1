"""Every registered architecture, on a tiny checkpoint of its transformers family saved
with `save_pretrained`, gives transformers' greedy tokens in fp32 (logprobs within
FP32_LOGPROB_TOLERANCE), with prefix caching and chunked prefill on, in a mixed batch
and one request at a time (tests/correctness/tiny_checkpoints.py).
"""

from __future__ import annotations

import pytest

from correctness.architecture_cases import all_cases
from correctness.tiny_checkpoints import (
    TinyCase,
    TinyRun,
    hf_references,
    write_tiny_checkpoint,
)

# Each family's cases live in its module of correctness/architecture_cases/.
CASES = all_cases()


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.id)
def tiny_run(request, tmp_path_factory, tiny_tokenizer, tiny_prompts) -> TinyRun:
    case: TinyCase = request.param
    folder = write_tiny_checkpoint(case.config, tmp_path_factory.mktemp(case.id), tiny_tokenizer)
    return TinyRun(str(folder), tiny_prompts, hf_references(folder, tiny_prompts))


def test_a_mixed_batch_matches_transformers(tiny_run: TinyRun) -> None:
    with tiny_run.llm() as llm:
        # Prompts longer than CHUNK_TOKENS (the step's token budget) prefill in chunks.
        tiny_run.check(llm, batched=True)


def test_one_request_at_a_time_matches_transformers_with_prefix_cache_hits(
    tiny_run: TinyRun,
) -> None:
    with tiny_run.llm() as llm:
        tiny_run.check(llm, batched=False)
        # The last prompt's first 32 tokens (two blocks) came from the longest one's.
        assert llm.engine.scheduler.kv.stats().prefix_cache_hits >= 2 * 16
