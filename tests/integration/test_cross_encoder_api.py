"""A cross-encoder served: a tiny random BertForSequenceClassification with one label,
paired with the embedded MiniLM's BERT tokenizer, behind /score, /rerank and /classify.
Each (query, document) pair runs as one prompt with the tokenizer's segment ids, and its
score is the head's sigmoid, as transformers computes it for the same pair, also where
truncate_prompt_tokens cuts the pair as the tokenizer truncates it."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest
import torch

from .conftest import NUM_THREADS, assert_openai_error, running_server

QUERY = "how do plants make sugar"
# Shorter than every pair: each keeps [CLS] query [SEP] document [SEP] in this many.
TRUNCATE = 9
DOCUMENTS = [
    "Photosynthesis turns light into chemical energy.",
    "The printing press spread across Europe.",
    "Leaves look green because chlorophyll absorbs red and blue light.",
]


@pytest.fixture(scope="module")
def cross_encoder_folder(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification

    from plugserve.model_files import resolve_model_path

    minilm = resolve_model_path("all-minilm-l6-v2")
    folder = tmp_path_factory.mktemp("cross-encoder")
    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.2)
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(minilm / name, folder / name)
    return folder


def settings(folder) -> tuple[str, ...]:
    return (
        "--model", str(folder),
        "--dtype", "float32",
        "--kv-cache-memory", "16MiB",
        "--num-threads", str(NUM_THREADS),
        "--shutdown-timeout", "10",
    )  # fmt: skip


def reference_scores(folder, max_length: int | None = None) -> list[float]:
    """transformers' sigmoid of each pair, truncated by the tokenizer to `max_length`."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = BertForSequenceClassification.from_pretrained(folder).eval()
    cut = {} if max_length is None else {"truncation": True, "max_length": max_length}
    with torch.inference_mode():
        return [
            float(model(**tokenizer(QUERY, d, return_tensors="pt", **cut)).logits[0, 0].sigmoid())
            for d in DOCUMENTS
        ]


def test_rerank_score_and_classify_equal_transformers(cross_encoder_folder, tmp_path):
    expected = reference_scores(cross_encoder_folder)
    truncated = reference_scores(cross_encoder_folder, max_length=TRUNCATE)
    with running_server("zmq", tmp_path, settings=settings(cross_encoder_folder)) as server:
        rerank = httpx.post(
            server.url("/v1/rerank"), json={"query": QUERY, "documents": DOCUMENTS}, timeout=60
        ).json()
        score = httpx.post(
            server.url("/score"), json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60
        ).json()
        cut = {"text_1": QUERY, "text_2": DOCUMENTS, "truncate_prompt_tokens": TRUNCATE}
        cut_score = httpx.post(server.url("/score"), json=cut, timeout=60).json()
        too_short = httpx.post(
            server.url("/score"), json={**cut, "truncate_prompt_tokens": 4}, timeout=60
        )
        classify = httpx.post(server.url("/classify"), json={"input": QUERY}, timeout=60).json()
        embed = httpx.post(server.url("/v1/embeddings"), json={"input": QUERY}, timeout=60)
        card = httpx.get(server.url("/v1/models"), timeout=30).json()["data"][0]
    got = [d["score"] for d in score["data"]]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert [r["index"] for r in rerank["results"]] == list(np.argsort(expected)[::-1])
    # The same pairs, scored in another step's batch: fp32 sums in another order.
    np.testing.assert_allclose(
        [r["relevance_score"] for r in rerank["results"]], sorted(got, reverse=True), atol=1e-5
    )
    # truncate_prompt_tokens: the pair cut by the tokenizer, longest text first.
    np.testing.assert_allclose(
        [d["score"] for d in cut_score["data"]], truncated, rtol=0, atol=1e-5
    )
    assert not np.allclose(truncated, expected, rtol=0, atol=1e-3)
    error = assert_openai_error(too_short, 400)
    assert error["param"] == "truncate_prompt_tokens" and "at least 5" in error["message"]
    (one,) = classify["data"]
    assert one["num_classes"] == 1 and one["label"] == "LABEL_0"
    assert card["task"] == ["classify", "score"]
    error = assert_openai_error(embed, 400)
    assert "serves classify, score" in error["message"]
