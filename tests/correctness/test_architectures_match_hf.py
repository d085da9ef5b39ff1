"""Every registered architecture, on a tiny checkpoint of its transformers family saved
with `save_pretrained`, gives transformers' greedy tokens in fp32 (logprobs within
FP32_LOGPROB_TOLERANCE), with prefix caching and chunked prefill on, in a mixed batch
and one request at a time (tests/correctness/tiny_checkpoints.py).
"""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from correctness.tiny_checkpoints import (
    TinyCase,
    TinyRun,
    hf_references,
    tiny,
    write_tiny_checkpoint,
)

CASES = [
    TinyCase("llama-tied", LlamaConfig(**tiny(tie_word_embeddings=True))),
    TinyCase(
        "llama-untied-biases-llama3-rope",
        LlamaConfig(
            **tiny(
                tie_word_embeddings=False,
                attention_bias=True,
                mlp_bias=True,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 50000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            )
        ),
    ),
    TinyCase("qwen2-qkv-bias-untied", Qwen2Config(**tiny(tie_word_embeddings=False))),
    TinyCase("qwen2-qkv-bias-tied", Qwen2Config(**tiny(tie_word_embeddings=True))),
    # q/k norm; head_dim 32 from the config, not hidden_size / num_heads (16), as
    # Qwen3's 128 is not; tied as the small Qwen3s, untied as the large ones.
    TinyCase("qwen3-qk-norm-tied", Qwen3Config(**tiny(head_dim=32, tie_word_embeddings=True))),
    TinyCase("qwen3-qk-norm-untied", Qwen3Config(**tiny(head_dim=32, tie_word_embeddings=False))),
]


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
