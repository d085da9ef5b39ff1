"""Every registered architecture, on a tiny checkpoint of its transformers family saved
with `save_pretrained`, gives transformers' greedy tokens in fp32 (logprobs within
FP32_LOGPROB_TOLERANCE), with prefix caching and chunked prefill on, in a mixed batch
and one request at a time (one engine for both), and in a mixed batch over TP_SIZE
tensor-parallel worker processes and over two pipeline stages, one case per family
(tests/correctness/tiny_checkpoints.py).
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
from model_support import PagedRunner, make_backend

from correctness.architecture_cases import all_cases, one_case_per_family
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
from plugserve.interfaces.model import FULL_ATTENTION

# Each family's cases live in its module of correctness/architecture_cases/.
CASES = all_cases()
NUM_BLOCKS = 16


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


class TwoStages:
    """Two pipeline stages of one model in this process, driven as one model and one
    attention backend (tests/model_support.PagedRunner): the first stage's activations
    go straight into the second."""

    def __init__(self, first: tuple[Any, Any], last: tuple[Any, Any]) -> None:
        (self.first, self.first_kv), (self.last, self.last_kv) = first, last

    def prepare(self, batch: Any) -> None:
        self.first_kv.prepare(batch)
        self.last_kv.prepare(batch)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        activations = self.first.forward_stage(ids, positions, None)
        return self.last.forward_stage(ids, positions, activations)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.last.compute_logits(hidden)


def test_every_family_split_into_stages_computes_what_the_whole_model_does(runs) -> None:
    """Per family, its checkpoint loaded whole and as two pipeline stages (split evenly),
    in this process: a stage holds only its layers, the first no final norm or head, the
    last no embedding unless its head is tied to it, each stage's attention backend the
    KV cache of its own layers only; and the stages chained give the whole model's
    logits exactly, at a prefill and at the decodes after it."""
    from transformers import AutoConfig

    from plugserve.model_files import check_architecture
    from plugserve.plugins import get_registry
    from plugserve.worker.layer_attention import attention_layers
    from plugserve.worker.model_loader import load_model
    from plugserve.worker.parallel import PipelineStage, stage_layer_ranges

    registry = get_registry()
    for case in one_case_per_family():
        folder = runs(case).model
        model_cls = registry.get(
            "model", check_architecture(folder, registry.implementations("model"))
        )
        config = AutoConfig.from_pretrained(folder)
        num_layers = config.num_hidden_layers
        layers = list(attention_layers(model_cls, config)) or [FULL_ATTENTION] * num_layers

        def build(stage: PipelineStage | None) -> tuple[Any, Any]:
            span = slice(stage.first_layer, stage.end_layer) if stage else slice(None)
            kv_config = copy.copy(config)  # noqa: B023 - called in this iteration only
            kv_config.num_hidden_layers = len(layers[span])  # noqa: B023
            backend = make_backend(kv_config, NUM_BLOCKS, layers=layers[span])  # noqa: B023
            cpu = torch.device("cpu")
            model = load_model(folder, model_cls, backend, torch.float32, cpu, stage=stage)  # noqa: B023
            return model, backend

        whole = PagedRunner(*build(None), NUM_BLOCKS)
        (a, b), (_, end) = stage_layer_ranges(num_layers, 2)
        first, last = build(PipelineStage(0, 2, a, b)), build(PipelineStage(1, 2, b, end))
        assert first[1].kv_cache.shape[0] == b and last[1].kv_cache.shape[0] == end - b
        first_names = [name for name, _ in first[0].named_parameters()]
        last_names = [name for name, _ in last[0].named_parameters()]
        others = tuple(f"model.layers.{i}." for i in range(b, end))
        assert not [n for n in first_names if n.startswith(("model.norm.", "lm_head.", *others))]
        assert not [
            n for n in last_names if n.startswith(tuple(f"model.layers.{i}." for i in range(b)))
        ]
        assert config.tie_word_embeddings == any(
            n.startswith("model.embed_tokens.") for n in last_names
        )
        staged = TwoStages(first, last)
        chained = PagedRunner(staged, staged, NUM_BLOCKS)
        prompt = runs(case).prompts[3]
        expected = whole.step([("a", prompt)])
        assert torch.equal(chained.step([("a", prompt)]), expected), case.id
        for _ in range(3):
            token = [int(expected[-1].argmax())]
            expected = whole.step([("a", token)])
            assert torch.equal(chained.step([("a", token)]), expected), case.id


# End to end over two mp worker processes: Qwen3-MoE (a dense and a mixture-of-experts
# layer, its checkpoint's experts routed to the stage that holds them). Every family's
# split is held above, in process; tests/correctness/test_pipeline_parallel.py runs TP x PP.
PIPELINE_CASES = ("qwen3-moe-renormalized-dense-layer-tied",)


@pytest.fixture(
    scope="module",
    params=[case for case in CASES if case.id in PIPELINE_CASES],
    ids=lambda case: case.id,
)
def stage_run(request, runs) -> TinyRun:
    return runs(request.param)


def test_two_pipeline_stages_match_transformers(stage_run: TinyRun) -> None:
    """Two pipeline stages in two mp worker processes, the activations crossing between
    them, batches in flight on both: transformers' tokens, within the tolerance of one
    process (a stage computes its layers as one process does)."""
    with stage_run.llm(executor="mp", pipeline_parallel_size=2, num_threads=1) as llm:
        largest = stage_run.check(llm, batched=True)
    print(f"PP=2: largest logprob difference {largest:.1e}")


def test_shapes_the_layers_cannot_shard_are_refused_with_the_reason(tmp_path) -> None:
    from transformers import LlamaConfig

    # One query head cannot be split over two ranks; four over two KV heads can.
    LlamaConfig(**tiny(num_attention_heads=1, num_key_value_heads=1)).save_pretrained(tmp_path)
    refusal = tensor_parallel_refusal(str(tmp_path), 2)
    assert refusal is not None and "cannot shard 1 query heads" in refusal
    LlamaConfig(**tiny()).save_pretrained(tmp_path)
    assert tensor_parallel_refusal(str(tmp_path), 2) is None


def test_every_architecture_plugserve_ships_has_a_case() -> None:
    """Here for generation, or in test_pooling_architectures_match_hf.py for pooling (the
    encoders and the sequence classifiers)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    from correctness.test_pooling_architectures_match_hf import CASES as POOLING_CASES
    from plugserve.plugins import BUILTIN_DISTRIBUTION, get_registry

    shipped = {
        name
        for name, impl in get_registry().implementations("model").items()
        if impl.distribution == BUILTIN_DISTRIBUTION
    }
    proven = {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[case.config.model_type] for case in CASES}
    by_auto_class = {
        "AutoModel": MODEL_MAPPING_NAMES,
        "AutoModelForSequenceClassification": MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        "AutoModelForCausalLM": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    }
    proven |= {by_auto_class[case.auto_class][case.config().model_type] for case in POOLING_CASES}
    assert sorted(shipped - proven) == []
