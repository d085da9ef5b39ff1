"""How a checkpoint is served for pooling, from its files alone (pooling_setup.py), what a
stack may not select with it (refused before any process starts), and PoolingParams'
validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from plugserve import LLM
from plugserve.config import load_config
from plugserve.pooling_params import PoolingParams
from plugserve.pooling_setup import check_pooling_stack, pooling_setup

PLUGSERVE = str(Path(sys.executable).parent / "plugserve")


def folder(tmp_path, architecture: str, **files) -> object:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": [architecture], "hidden_size": 8, **files.pop("config", {})})
    )
    for name, content in files.items():
        path = tmp_path / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return tmp_path


def test_the_embedded_minilm_pools_by_its_sentence_transformers_files():
    from plugserve.model_files import resolve_model_path

    setup = pooling_setup(resolve_model_path("all-minilm-l6-v2"))
    assert (setup.runner, setup.architecture, setup.pooler) == ("pooling", "BertModel", "mean")
    assert setup.normalize and setup.is_encoder and setup.max_seq_length == 256
    assert setup.tasks == ("embed", "token_embed", "score")


def test_a_causal_lm_generates_unless_it_has_sentence_transformers_files(tmp_path):
    assert pooling_setup(folder(tmp_path, "Qwen3ForCausalLM")).runner == "generate"
    modules = [
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    path = folder(
        tmp_path,
        "Qwen3ForCausalLM",
        **{"modules.json": modules, "1_Pooling__config.json": {"pooling_mode_lasttoken": True}},
    )
    setup = pooling_setup(path)
    # Without a Normalize module, the vectors are left as pooled.
    assert (setup.runner, setup.pooler, setup.normalize, setup.is_encoder) == (
        "pooling", "last", False, False,
    )  # fmt: skip
    assert pooling_setup(path, pooler="mean").pooler == "mean"  # stack.pooler overrides


def test_a_decoder_asked_to_pool_takes_its_last_token_and_normalises(tmp_path):
    setup = pooling_setup(folder(tmp_path, "Qwen2ForCausalLM"), runner="pooling")
    assert (setup.pooler, setup.normalize) == ("last", True)


def test_a_classifier_pools_its_cls_token_and_names_its_labels(tmp_path):
    config = {"num_labels": 2, "id2label": {"0": "no", "1": "yes"}}
    setup = pooling_setup(folder(tmp_path, "XLMRobertaForSequenceClassification", config=config))
    assert (setup.pooler, setup.num_labels, setup.id2label) == ("cls", 2, ("no", "yes"))
    assert setup.tasks == ("classify", "score")


def test_an_encoder_cannot_be_asked_to_generate(tmp_path):
    with pytest.raises(ValueError, match="BertModel has no language-model head"):
        pooling_setup(folder(tmp_path, "BertModel"), runner="generate")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task": "sample"}, "task must be one of"),
        ({"dimensions": 0}, "dimensions must be at least 1"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be at least 1"),
        ({"task": "classify", "dimensions": 4}, "dimensions applies to embeddings"),
    ],
)
def test_pooling_params_refuse_what_cannot_be(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolingParams(**kwargs)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"speculative": {"proposer": "ngram"}}, "stack.speculative (ngram)"),
        ({"pipeline_parallel_size": 2, "executor": "mp"}, "engine.pipeline_parallel_size (2)"),
        ({"reasoning_parser": "qwen3"}, "stack.reasoning_parser (qwen3)"),
        ({"cuda_graphs": True}, "engine.cuda_graphs (true)"),
    ],
)
def test_a_pooling_model_refuses_what_only_generation_uses(tmp_path, settings, named):
    path = folder(tmp_path, "BertModel")
    config = load_config(None, {"model": str(path), **settings}, check_plugins=False)
    with pytest.raises(ValueError) as refused:
        check_pooling_stack(path, config)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(named)
    assert "serves BertModel for pooling" in message


def test_a_pooler_for_a_generating_model_is_refused(tmp_path):
    path = folder(tmp_path, "Qwen3ForCausalLM")
    config = load_config(None, {"model": str(path), "pooler": "mean"}, check_plugins=False)
    with pytest.raises(ValueError, match=r"stack\.pooler \(mean\) is set, but .* to generate"):
        check_pooling_stack(path, config)
    plain = load_config(None, {"model": str(path)}, check_plugins=False)
    assert check_pooling_stack(path, plain).runner == "generate"


def test_llm_and_serve_refuse_speculation_on_a_pooling_model_before_loading():
    with pytest.raises(ValueError, match=r"^stack\.speculative \(ngram\) cannot be used: "):
        LLM("all-minilm-l6-v2", speculative={"proposer": "ngram"})
    result = subprocess.run(
        [PLUGSERVE, "serve", "--model", "all-minilm-l6-v2", "--port", "0",
         "--stack.speculative.proposer", "ngram"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1
    assert "stack.speculative (ngram) cannot be used" in result.stderr
    assert "serves BertModel for pooling" in result.stderr
