"""A tiny checkpoint reached the ways users name theirs (a Hugging Face Hub id found in
the local cache, a GGUF of a non-Llama architecture) serves transformers' greedy tokens,
by the harness of tests/correctness/tiny_checkpoints.py. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from correctness.tiny_checkpoints import (
    TinyRun,
    hf_references,
    put_in_hub_cache,
    tiny,
    write_gguf,
    write_tiny_checkpoint,
)
from plugserve.model_files import model_architecture, resolve_model_path
from plugserve.worker.model_loader import iter_weights


def test_a_hub_id_in_the_local_cache_serves_transformers_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_tokenizer: Path, tiny_prompts
) -> None:
    folder = write_tiny_checkpoint(
        LlamaConfig(**tiny(tie_word_embeddings=True)), tmp_path / "src", tiny_tokenizer
    )
    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snapshot = put_in_hub_cache(folder, cache, "tiny-org/tiny-llama")
    assert resolve_model_path("tiny-org/tiny-llama") == snapshot

    run = TinyRun("tiny-org/tiny-llama", tiny_prompts, hf_references(folder, tiny_prompts))
    with run.llm() as llm:
        run.check(llm, batched=True)


def test_a_qwen2_gguf_converts_to_its_tensors_and_serves_transformers_tokens(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tiny_tokenizer: Path,
    tiny_prompts,
    smollm2_gguf: Path,
) -> None:
    """qwen2 is no 'llama' GGUF: transformers' GGUF loader converts it (its q/k rows are
    not permuted, its q/k/v have biases), and the folder holds the very tensors written."""
    monkeypatch.setenv("PLUGSERVE_CACHE_DIR", str(tmp_path / "plugserve-cache"))
    folder = write_tiny_checkpoint(
        Qwen2Config(**tiny(tie_word_embeddings=False)), tmp_path / "src", tiny_tokenizer
    )
    gguf_path = write_gguf(folder, tmp_path / "tiny-qwen2.gguf", "qwen2", smollm2_gguf)

    converted = resolve_model_path(str(gguf_path))
    assert model_architecture(converted) == "Qwen2ForCausalLM"
    written, read = dict(iter_weights(folder)), dict(iter_weights(converted))
    assert sorted(read) == sorted(written)
    for name, tensor in written.items():
        assert torch.equal(read[name], tensor), name

    run = TinyRun(str(gguf_path), tiny_prompts, hf_references(folder, tiny_prompts))
    with run.llm() as llm:
        run.check(llm, batched=True)
