"""The example third-party pooler (tests/plugins/plugserve-max-pooler, installed by the
Makefile like any package): found through its entry point and selected with
`stack.pooler: max`, it pools the embedded MiniLM as transformers' BertModel plus an
element-wise max over the tokens, then the checkpoint's normalisation, computes."""

from __future__ import annotations

import numpy as np
import torch

from plugserve import LLM
from plugserve.plugins import get_registry

SENTENCES = ["A man is eating food.", "hi", "Two men pushed carts through the woods."]


def test_registered_from_its_own_distribution():
    (implementation,) = [
        impl for name, impl in get_registry().implementations("pooler").items() if name == "max"
    ]
    assert implementation.distribution == "plugserve-max-pooler"


def test_max_pooling_matches_transformers():
    from transformers import AutoModel, AutoTokenizer

    from plugserve.model_files import resolve_model_path

    path = resolve_model_path("all-minilm-l6-v2")
    llm = LLM("all-minilm-l6-v2", dtype="float32", pooler="max", kv_cache_memory="16MiB")
    got = np.stack(llm.encode(SENTENCES))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    with torch.inference_mode():
        expected = [
            torch.nn.functional.normalize(
                model(**tokenizer(s, return_tensors="pt")).last_hidden_state[0].amax(0), dim=0
            ).numpy()
            for s in SENTENCES
        ]
    np.testing.assert_allclose(got, np.stack(expected), rtol=0, atol=2e-5)
