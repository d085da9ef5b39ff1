"""Every registered architecture, on a tiny checkpoint of its transformers family saved
with `save_pretrained`, gives transformers' greedy tokens in fp32 (logprobs within
FP32_LOGPROB_TOLERANCE), with prefix caching and chunked prefill on, in a mixed batch
and one request at a time, and in a mixed batch over TP_SIZE tensor-parallel worker
processes wherever its layers can shard its shapes (tests/correctness/tiny_checkpoints.py).
"""

from __future__ import annotations

import pytest

from correctness.architecture_cases import all_cases
from correctness.tiny_checkpoints import (
    FP32_TP_LOGPROB_TOLERANCE,
    TP_SIZE,
    TinyCase,
    TinyRun,
    hf_references,
    tensor_parallel_refusal,
    tiny,
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


def test_tensor_parallel_worker_processes_match_transformers(tiny_run: TinyRun) -> None:
    refusal = tensor_parallel_refusal(tiny_run.model)
    if refusal is not None:
        pytest.skip(f"its shapes do not shard over {TP_SIZE} ranks: {refusal}")
    # One engine of TP_SIZE worker processes per case (~4 s, most of it starting them).
    with tiny_run.tensor_parallel_llm() as llm:
        largest = tiny_run.check(llm, batched=True, tolerance=FP32_TP_LOGPROB_TOLERANCE)
    print(f"TP={TP_SIZE}: largest logprob difference {largest:.1e}")


def test_shapes_the_layers_cannot_shard_are_refused_with_the_reason(tmp_path) -> None:
    from transformers import LlamaConfig

    # One query head cannot be split over two ranks; four over two KV heads can.
    LlamaConfig(**tiny(num_attention_heads=1, num_key_value_heads=1)).save_pretrained(tmp_path)
    refusal = tensor_parallel_refusal(str(tmp_path), 2)
    assert refusal is not None and "cannot shard 1 query heads" in refusal
    LlamaConfig(**tiny()).save_pretrained(tmp_path)
    assert tensor_parallel_refusal(str(tmp_path), 2) is None


def test_every_architecture_plugserve_ships_has_a_case() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from plugserve.plugins import BUILTIN_DISTRIBUTION, get_registry

    shipped = {
        name
        for name, impl in get_registry().implementations("model").items()
        if impl.distribution == BUILTIN_DISTRIBUTION
    }
    proven = {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[case.config.model_type] for case in CASES}
    assert sorted(shipped - proven) == []
