"""Every registered architecture, on a tiny checkpoint of its transformers family saved
with `save_pretrained`, gives transformers' greedy tokens in fp32 (logprobs within
FP32_LOGPROB_TOLERANCE), with prefix caching and chunked prefill on, in a mixed batch
and one request at a time (one engine for both), and in a mixed batch over TP_SIZE
tensor-parallel worker processes, one case per family (tests/correctness/tiny_checkpoints.py).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_tokenizer, tiny_prompts) -> Callable[[TinyCase], TinyRun]:
    """run(case): its checkpoint and transformers' references, written and computed once
    for both tests that take the case."""
    made: dict[str, TinyRun] = {}

    def run(case: TinyCase) -> TinyRun:
        if case.id not in made:
            folder = write_tiny_checkpoint(
                case.config, tmp_path_factory.mktemp(case.id), tiny_tokenizer
            )
            made[case.id] = TinyRun(str(folder), tiny_prompts, hf_references(folder, tiny_prompts))
        return made[case.id]

    return run


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.id)
def tiny_run(request, runs) -> TinyRun:
    return runs(request.param)


def sharding_cases() -> list[TinyCase]:
    """Per family, the first case whose shapes shard over TP_SIZE ranks: sharding is the
    family's layers', which its other cases' options do not change."""
    first: dict[type, TinyCase] = {}
    for case in CASES:
        if type(case.config) in first:
            continue
        with tempfile.TemporaryDirectory() as folder:
            case.config.save_pretrained(folder)
            if tensor_parallel_refusal(folder, TP_SIZE) is None:
                first[type(case.config)] = case
    return list(first.values())


@pytest.fixture(scope="module", params=sharding_cases(), ids=lambda case: case.id)
def family_run(request, runs) -> TinyRun:
    return runs(request.param)


def test_a_mixed_batch_and_one_request_at_a_time_match_transformers(tiny_run: TinyRun) -> None:
    """One engine serves both runs: the mixed batch, where prompts longer than CHUNK_TOKENS
    (the step's token budget) prefill in chunks; then, the prefix cache emptied, each
    prompt alone, the last finding its first 32 tokens (two blocks) in the longest one's."""
    with tiny_run.llm() as llm:
        tiny_run.check(llm, batched=True)
        kv = llm.engine.scheduler.kv
        assert kv.reset_prefix_cache()  # nothing runs: every block is free to forget
        hits = kv.stats().prefix_cache_hits
        tiny_run.check(llm, batched=False)
        assert kv.stats().prefix_cache_hits - hits >= 2 * 16


def test_tensor_parallel_worker_processes_match_transformers(family_run: TinyRun) -> None:
    """Per family (sharding_cases), one engine of TP_SIZE worker processes (~4 s, most of
    it starting them)."""
    with family_run.tensor_parallel_llm() as llm:
        largest = family_run.check(llm, batched=True, tolerance=FP32_TP_LOGPROB_TOLERANCE)
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
