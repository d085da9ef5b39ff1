"""The embedded all-MiniLM-L6-v2 through plugserve equals sentence-transformers' `encode`
of the same folder: BERT's layers, the mean pooling its 1_Pooling config names and its
Normalize module, read from the checkpoint's own files.

fp32 is held to a cosine of 0.99999 with every reference vector (what differs is
summation order: fused q/k/v, attention over unpadded prompts through SDPA or the varlen
kernel, matmuls through oneDNN or F.linear); bf16 rounds every matmul's inputs and is
held to 0.9995. truncate_prompt_tokens cuts a prompt as the tokenizer truncates at
sentence-transformers' max_seq_length: [CLS] and [SEP] kept, the text cut at its end. An
encoder's KV pool holds one step of whole prompts, not a generation's worth of sequences,
and none of its blocks goes into the prefix cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from plugserve import LLM
from plugserve.messages import EngineCoreRequest
from plugserve.pooling_params import PoolingParams
from plugserve.prompt_truncation import PromptTruncation
from plugserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.kernel_support import require_kernel

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
def sentence_transformer(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="module")
def reference(sentence_transformer) -> np.ndarray:
    return sentence_transformer.encode(SENTENCES, convert_to_numpy=True, batch_size=len(SENTENCES))


@pytest.fixture(scope="module")
def fp32_llm():
    # kv_cache_memory left at its default (1 GiB): the encoder's pool is sized by its steps.
    llm = LLM("all-minilm-l6-v2", dtype="float32")
    yield llm
    llm.engine.shutdown()


def cosines(got: list[np.ndarray], expected: np.ndarray) -> np.ndarray:
    got_matrix = np.stack(got).astype(np.float64)
    expected = expected.astype(np.float64)
    dots = (got_matrix * expected).sum(axis=1)
    return dots / np.linalg.norm(got_matrix, axis=1) / np.linalg.norm(expected, axis=1)


@pytest.mark.parametrize(
    ("prefill_kernel", "linear_kernel"),
    [("on", "onednn"), ("on", "fma"), ("off", "aten")],
    ids=["varlen-kernel-onednn", "varlen-kernel-fma", "sdpa-aten"],
)
def test_fp32_equals_sentence_transformers(prefill_kernel, linear_kernel, reference):
    """Through either attention path and each fp32 matmul (auto takes whichever timed
    fastest)."""
    from plugserve_plugins.kernels import cpu_prefill_attention
    from plugserve_plugins.linear_methods import cpu_fp32

    if prefill_kernel == "on":
        cpu_prefill_attention.load_fp32()
        require_kernel(
            "the fp32 varlen kernel",
            cpu_prefill_attention.fp32_kernel().required_cpu_flags,
            cpu_prefill_attention.fp32_unavailable_reason(),
        )
    if linear_kernel == "onednn" and not cpu_fp32.onednn_available():
        pytest.skip("this torch is built without oneDNN")
    if linear_kernel == "fma":
        require_kernel(
            "the FMA tiles fp32 matmul",
            cpu_fp32.FMA_REQUIRED_CPU_FLAGS,
            cpu_fp32.fma_unavailable_reason(),
        )
    llm = LLM(
        "all-minilm-l6-v2",
        dtype="float32",
        **{
            "plugins.torch.prefill_kernel": prefill_kernel,
            "plugins.cpu_fp32.kernel": linear_kernel,
        },
    )
    batched = llm.encode(SENTENCES)  # every sentence in one step
    alone = [llm.encode(s)[0] for s in SENTENCES[:3]]
    assert all(v.shape == (384,) and v.dtype == np.float32 for v in batched)
    assert cosines(batched, reference).min() >= FP32_MIN_COSINE
    assert cosines(alone, reference[:3]).min() >= FP32_MIN_COSINE
    # The checkpoint's Normalize module: unit vectors, as sentence-transformers'.
    np.testing.assert_allclose(np.linalg.norm(np.stack(batched), axis=1), 1.0, rtol=1e-5)
    llm.engine.shutdown()


def test_bf16_agrees_with_sentence_transformers(reference):
    llm = LLM("all-minilm-l6-v2", dtype="bfloat16", kv_cache_memory="16MiB")
    worst = cosines(llm.encode(SENTENCES), reference).min()
    assert worst >= BF16_MIN_COSINE, f"min cosine {worst:.6f}"


def test_truncated_prompts_equal_sentence_transformers_at_that_max_seq_length(
    fp32_llm, sentence_transformer
):
    max_tokens = 6
    tokenizer = sentence_transformer.tokenizer
    texts = [s for s in SENTENCES if len(tokenizer(s)["input_ids"]) > max_tokens]
    saved = sentence_transformer.max_seq_length
    sentence_transformer.max_seq_length = max_tokens
    try:
        expected = sentence_transformer.encode(texts, convert_to_numpy=True)
    finally:
        sentence_transformer.max_seq_length = saved
    got = fp32_llm.encode(texts, PoolingParams(truncate_prompt_tokens=max_tokens))
    assert len(texts) >= 8 and cosines(got, expected).min() >= FP32_MIN_COSINE
    # [CLS] and [SEP] stay, the text is cut at its end: the tokenizer's own truncation.
    truncation = PromptTruncation.of_tokenizer(tokenizer)
    for text in texts:
        cut = tokenizer(text, truncation=True, max_length=max_tokens)["input_ids"]
        assert truncation.truncate(tokenizer(text)["input_ids"], max_tokens) == cut
        assert cut[0] == tokenizer.cls_token_id and cut[-1] == tokenizer.sep_token_id


def test_an_encoders_kv_pool_holds_one_step_of_whole_prompts(fp32_llm):
    engine = fp32_llm.config.engine
    # One-token prompts, max_num_seqs of them, the rest of the step's budget in full blocks.
    one_step = (
        engine.max_num_seqs
        + (engine.max_num_batched_tokens - engine.max_num_seqs) // engine.block_size
    )
    info = fp32_llm.engine.kv_cache_info
    assert info.num_blocks == one_step
    # What 1 GiB would hold, and every sequence at full length would use: far more.
    per_sequence = -(-info.max_model_len // engine.block_size)
    assert info.num_blocks < engine.max_num_seqs * per_sequence / 4


def test_an_encoder_caches_no_prefix_blocks(fp32_llm):
    # Its prompts run whole and its layers keep no K/V: a block of one is never a prefix
    # another request starts from, so none is hashed into the prefix cache.
    assert fp32_llm.config.engine.enable_prefix_caching
    assert not fp32_llm.engine.scheduler.kv.enable_prefix_caching


def test_a_pooling_request_asking_to_sample_is_refused_by_name(fp32_llm):
    request = EngineCoreRequest(
        request_id="constrained",
        prompt_token_ids=[101, 7592, 102],
        sampling_params=SamplingParams(
            max_tokens=1, structured_outputs=StructuredOutputsParams(json_object=True)
        ),
        pooling_params=PoolingParams(),
    )
    with pytest.raises(ValueError, match=r"sampling_params\.structured_outputs does not apply"):
        fp32_llm.engine.add_request(request)
