"""How a checkpoint is served for pooling, from its files alone (pooling_setup.py), and
PoolingParams' validation."""

from __future__ import annotations

import json

import pytest

from plugserve.pooling_params import PoolingParams
from plugserve.pooling_setup import pooling_setup


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
