"""The pooling endpoints on a live server serving the embedded all-MiniLM-L6-v2:
/v1/embeddings through the official openai SDK (float and base64) and plain HTTP (every
input shape OpenAI takes, Matryoshka `dimensions`, usage, truncate_prompt_tokens cutting
as the tokenizer truncates); /pooling, /score, and a Cohere/Jina-shaped rerank on
/rerank, /v1/rerank and /v2/rerank over httpx; /v1/models saying the task. Bad input is a 400 in OpenAI's shape while requests in flight beside it
finish unharmed; generating on a pooling model, or classifying with an embedder, is a
400 naming why.

One server for the module, launched ahead like every server of the suite.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest

from .conftest import NUM_THREADS, assert_openai_error, running_server

MINILM = "all-minilm-l6-v2"
MINILM_SETTINGS = (
    "--model", MINILM,
    "--dtype", "float32",
    "--kv-cache-memory", "32MiB",
    "--max-num-seqs", "32",
    "--num-threads", str(NUM_THREADS),
    "--shutdown-timeout", "10",
)  # fmt: skip
SENTENCES = ["A man is eating food.", "The girl is carrying a baby.", "hi"]
MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def minilm_server(tmp_path_factory):
    with running_server("zmq", tmp_path_factory.mktemp("minilm"), settings=MINILM_SETTINGS) as s:
        yield s


@pytest.fixture(scope="module")
def sentence_transformer():
    from sentence_transformers import SentenceTransformer

    from plugserve.model_files import resolve_model_path

    return SentenceTransformer(str(resolve_model_path(MINILM)), device="cpu")


@pytest.fixture(scope="module")
def reference(sentence_transformer) -> np.ndarray:
    return sentence_transformer.encode(SENTENCES, convert_to_numpy=True)


def min_cosine(got: np.ndarray, expected: np.ndarray) -> float:
    got, expected = got.astype(np.float64), expected.astype(np.float64)
    dots = (got * expected).sum(axis=-1)
    return float((dots / np.linalg.norm(got, axis=-1) / np.linalg.norm(expected, axis=-1)).min())


@pytest.mark.starts_server(transport="zmq", settings=MINILM_SETTINGS)
def test_openai_sdk_embeddings_float_and_base64(minilm_server, reference):
    with minilm_server.openai_client() as client:
        floats = client.embeddings.create(model=MINILM, input=SENTENCES, encoding_format="float")
        raw = client.embeddings.create(model=MINILM, input=SENTENCES, encoding_format="base64")
        # Without encoding_format the SDK asks for base64 and decodes it itself.
        decoded = client.embeddings.create(model=MINILM, input=SENTENCES)
    as_float = np.array([d.embedding for d in floats.data], dtype=np.float32)
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert min_cosine(as_float, reference) >= MIN_COSINE
    from_base64 = np.stack(
        [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data]
    )
    # Three requests, batched as they arrived: a matmul's summation order may differ.
    np.testing.assert_allclose(from_base64, as_float, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.array([d.embedding for d in decoded.data]), as_float, atol=2e-6)
    tokens = floats.usage.prompt_tokens
    assert tokens == floats.usage.total_tokens == 8 + 9 + 3  # [CLS] ... [SEP] each
    assert floats.model == MINILM


def test_token_ids_and_dimensions(minilm_server):
    url = minilm_server.url("/v1/embeddings")
    text = httpx.post(url, json={"input": "hello world"}, timeout=60).json()
    ids = [101, 7592, 2088, 102]  # the same prompt, as the tokenizer writes it
    one = httpx.post(url, json={"input": ids}, timeout=60).json()
    several = httpx.post(url, json={"input": [ids, ids[:2]]}, timeout=60).json()
    full = np.array(text["data"][0]["embedding"])
    np.testing.assert_allclose(one["data"][0]["embedding"], full, rtol=0, atol=2e-6)
    assert len(several["data"]) == 2 and several["usage"]["prompt_tokens"] == 6
    cut = httpx.post(url, json={"input": "hello world", "dimensions": 32}, timeout=60).json()
    short = np.array(cut["data"][0]["embedding"])
    # Truncated, then renormalised: the unit vector along the full one's first 32 values.
    assert short.shape == (32,)
    np.testing.assert_allclose(short, full[:32] / np.linalg.norm(full[:32]), rtol=0, atol=1e-5)


def test_truncate_prompt_tokens_cuts_as_the_tokenizer_truncates(
    minilm_server, sentence_transformer
):
    url = minilm_server.url("/v1/embeddings")
    texts = ["A man is riding a white horse on an enclosed ground.", "hello world"]
    answer = httpx.post(url, json={"input": texts, "truncate_prompt_tokens": 5}, timeout=60)
    got = np.array([d["embedding"] for d in answer.json()["data"]])
    saved = sentence_transformer.max_seq_length
    sentence_transformer.max_seq_length = 5  # [CLS] a man is [SEP]
    try:
        expected = sentence_transformer.encode(texts, convert_to_numpy=True)
    finally:
        sentence_transformer.max_seq_length = saved
    # The long text is cut, the short one ([CLS] hello world [SEP]) left whole.
    assert min_cosine(got, expected) >= MIN_COSINE
    assert answer.json()["usage"]["prompt_tokens"] == 5 + 4
    # Token ids that start and end with the tokenizer's specials keep them: [CLS] hello [SEP].
    body = {"input": [101, 7592, 2088, 102], "truncate_prompt_tokens": 3}
    cut = httpx.post(url, json=body, timeout=60).json()["data"][0]["embedding"]
    hello = httpx.post(url, json={"input": "hello"}, timeout=60).json()["data"][0]["embedding"]
    np.testing.assert_allclose(cut, hello, rtol=0, atol=2e-6)


BAD_BODIES = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": "word " * 300}, "input"),  # more than the checkpoint's 256 tokens
    ({"input": "hi", "dimensions": 385}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "user": "someone"}, "user"),  # a field it does not implement
    ({"input": [1, 99_999_999]}, "input"),  # not in the vocabulary
    # Room for [CLS] and [SEP] only.
    ({"input": "hello world", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    # Nothing is sampled: a constraint on the output has no meaning here.
    ({"input": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "hi", "structured_outputs": {"json_object": True}}, "structured_outputs"),
]


def test_bad_input_is_a_400_and_requests_in_flight_finish(minilm_server, reference):
    url = minilm_server.url("/v1/embeddings")

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            good = [http.post(url, json={"input": SENTENCES}) for _ in range(4)]
            bad = [http.post(url, json=body) for body, _ in BAD_BODIES]
            return await asyncio.gather(*good, *bad)

    answers = asyncio.run(scenario())
    for response in answers[:4]:
        assert response.status_code == 200, response.text
        vectors = np.array([d["embedding"] for d in response.json()["data"]])
        assert min_cosine(vectors, reference) >= MIN_COSINE
    for response, (body, param) in zip(answers[4:], BAD_BODIES, strict=True):
        error = assert_openai_error(response, 400)
        assert error["param"] == param, (body, error)
    long = assert_openai_error(answers[4 + 3], 400)
    assert "maximum context length is 256 tokens" in long["message"]
    assert minilm_server.wait_idle()["num_requests_running"] == 0


def test_generating_on_a_pooling_model_is_a_400_naming_why(minilm_server):
    for path, body in (
        ("/v1/completions", {"model": MINILM, "prompt": "hi"}),
        (
            "/v1/chat/completions",
            {"model": MINILM, "messages": [{"role": "user", "content": "hi"}]},
        ),
    ):
        error = assert_openai_error(httpx.post(minilm_server.url(path), json=body, timeout=30), 400)
        assert "is a pooling model and does not generate" in error["message"], error


def test_models_says_the_task(minilm_server):
    (card,) = httpx.get(minilm_server.url("/v1/models"), timeout=30).json()["data"]
    assert card["task"] == ["embed", "token_embed", "score"]
    assert card["max_model_len"] == 256


def test_pooling_returns_the_embedding_or_every_token(minilm_server):
    url = minilm_server.url("/pooling")
    embed = httpx.post(url, json={"input": "hello world"}, timeout=60).json()
    body = {"input": "hello world", "task": "token_embed", "normalize": False}
    per_token = np.array(httpx.post(url, json=body, timeout=60).json()["data"][0]["data"])
    vector = np.array(embed["data"][0]["data"])
    assert vector.shape == (384,) and per_token.shape == (4, 384)  # [CLS] hello world [SEP]
    # The embedding is the checkpoint's mean pooling of those token states, normalised.
    mean = per_token.mean(axis=0)
    np.testing.assert_allclose(vector, mean / np.linalg.norm(mean), rtol=0, atol=1e-5)


DOCUMENTS = [
    "The weather is lovely today.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
]
QUERY = "A man is eating food."


def test_rerank_in_the_jina_and_cohere_shape(minilm_server, sentence_transformer):
    bodies = {
        "/rerank": {"query": QUERY, "documents": DOCUMENTS},
        "/v1/rerank": {"model": MINILM, "query": QUERY, "documents": DOCUMENTS, "top_n": 2},
        "/v2/rerank": {
            "model": MINILM,
            "query": QUERY,
            "documents": [{"text": d} for d in DOCUMENTS],
            "return_documents": False,
        },
    }
    answers = {
        path: httpx.post(minilm_server.url(path), json=b, timeout=60) for path, b in bodies.items()
    }
    full = answers["/rerank"].json()
    assert [r["index"] for r in full["results"]] == [1, 0, 2]  # the bread first
    assert full["results"][0]["document"] == {"text": DOCUMENTS[1]}
    assert full["usage"]["total_tokens"] > 0 and full["model"] == MINILM
    top = answers["/v1/rerank"].json()["results"]
    assert [r["index"] for r in top] == [1, 0]
    bare = answers["/v2/rerank"].json()["results"]
    assert len(bare) == 3 and all("document" not in r for r in bare)
    # An embedder scores a pair by the cosine of its two embeddings.
    score = httpx.post(
        minilm_server.url("/score"), json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60
    ).json()
    scores = [d["score"] for d in score["data"]]
    assert scores == pytest.approx(
        [r["relevance_score"] for r in sorted(full["results"], key=lambda r: r["index"])], abs=1e-5
    )
    q, *docs = sentence_transformer.encode([QUERY, *DOCUMENTS])
    assert scores == pytest.approx([float(np.dot(q, d)) for d in docs], abs=1e-5)


def test_bad_pooling_requests_are_400s_naming_why(minilm_server):
    cases = [
        ("/rerank", {"query": QUERY, "documents": []}, "documents", "documents is empty"),
        ("/rerank", {"query": "", "documents": ["x"]}, "query", "query is empty"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "text_1 has 2"),
        ("/classify", {"input": "hi"}, "model", "serves embed, token_embed, score"),
        (
            "/pooling",
            {"input": "hi", "task": "classify"},
            "model",
            "needs a model that serves classify",
        ),
    ]
    for path, body, param, words in cases:
        error = assert_openai_error(httpx.post(minilm_server.url(path), json=body, timeout=30), 400)
        assert error["param"] == param and words in error["message"], (path, error)


def test_pooling_on_a_generating_model_is_a_400_naming_why(zmq_server):
    """The reverse: the session's shared SmolLM2 server generates, and says so."""
    for path, body in (
        ("/v1/embeddings", {"input": "hi"}),
        ("/rerank", {"query": "q", "documents": ["d"]}),
    ):
        error = assert_openai_error(httpx.post(zmq_server.url(path), json=body, timeout=30), 400)
        assert "needs a pooling model; this model generates" in error["message"], error
