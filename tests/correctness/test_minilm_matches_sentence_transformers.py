"""The embedded all-MiniLM-L6-v2 through plugserve equals sentence-transformers' `encode`
of the same folder: BERT's layers, the mean pooling its 1_Pooling config names and its
Normalize module, read from the checkpoint's own files.

fp32 is held to a cosine of 0.99999 with every reference vector (what differs is
summation order: fused q/k/v, SDPA over unpadded prompts); bf16 rounds every matmul's
inputs and is held to 0.9995.
"""

from __future__ import annotations

import numpy as np
import pytest

from plugserve import LLM

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "hi",
    "Paged attention keeps the key and value cache in fixed-size blocks, so that "
    "requests of any length share one pool of memory without fragmentation.",
    "Ünïcödé, emoji 🙂 and numbers 3.14159 all tokenize somehow.",
]
FP32_MIN_COSINE = 0.99999
BF16_MIN_COSINE = 0.9995


@pytest.fixture(scope="module")
def minilm_path():
    from plugserve.model_files import resolve_model_path

    return resolve_model_path("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def reference(minilm_path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_path), device="cpu")
    return model.encode(SENTENCES, convert_to_numpy=True, batch_size=len(SENTENCES))


def cosines(got: list[np.ndarray], expected: np.ndarray) -> np.ndarray:
    got_matrix = np.stack(got).astype(np.float64)
    expected = expected.astype(np.float64)
    dots = (got_matrix * expected).sum(axis=1)
    return dots / np.linalg.norm(got_matrix, axis=1) / np.linalg.norm(expected, axis=1)


def test_fp32_equals_sentence_transformers(reference):
    llm = LLM("all-minilm-l6-v2", dtype="float32", kv_cache_memory="16MiB")
    batched = llm.encode(SENTENCES)  # every sentence in one step
    alone = [llm.encode(s)[0] for s in SENTENCES[:3]]
    assert all(v.shape == (384,) and v.dtype == np.float32 for v in batched)
    assert cosines(batched, reference).min() >= FP32_MIN_COSINE
    assert cosines(alone, reference[:3]).min() >= FP32_MIN_COSINE
    # The checkpoint's Normalize module: unit vectors, as sentence-transformers'.
    np.testing.assert_allclose(np.linalg.norm(np.stack(batched), axis=1), 1.0, rtol=1e-5)


def test_bf16_agrees_with_sentence_transformers(reference):
    llm = LLM("all-minilm-l6-v2", dtype="bfloat16", kv_cache_memory="16MiB")
    worst = cosines(llm.encode(SENTENCES), reference).min()
    assert worst >= BF16_MIN_COSINE, f"min cosine {worst:.6f}"
