"""Our LlamaForCausalLM + TorchPagedAttention against Hugging Face transformers.

The real SmolLM2 weights in fp32, prompts of different lengths run as one flat varlen
batch (with one prompt split into two chunks), then a decode step; plus tiny random
models covering what SmolLM2 does not use (biases, untied head, scaled RoPE, Qwen2).
bf16 on CPU through the fused layers: tests/unit/cpu_bf16/test_fused_decoder.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from plugserve.interfaces.model import CausalLM
from plugserve.model_files import load_tokenizer
from plugserve.worker.model_loader import load_model
from plugserve.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention
from tests.model_support import SIZES, PagedRunner, make_backend

# fp32 end to end; what remains is summation order (fused QKV/gate-up matmuls, SDPA over
# paged keys). Observed on SmolLM2 ≈ 2e-5; logits span about ±30.
LOGITS_ATOL = 1e-3


def model_class(config: Any) -> type[LlamaForCausalLM]:
    """The class registered for the config's architecture."""
    return Qwen2ForCausalLM if config.model_type == "qwen2" else LlamaForCausalLM


@torch.inference_mode()
def hf_last_logits(hf_model: Any, token_ids: list[int], count: int = 1) -> torch.Tensor:
    """Logits of the last `count` positions ([count, vocab]; [vocab] for one)."""
    logits = hf_model(torch.tensor([token_ids]), logits_to_keep=count).logits[0].float()
    return logits[0] if count == 1 else logits


# --------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path, hf_reference_model) -> tuple[Any, Any, TorchPagedAttention]:
    tokenizer = load_tokenizer(smollm2_path)
    hf_model = hf_reference_model(torch.float32)  # from the GGUF, by transformers itself
    backend = make_backend(hf_model.config, num_blocks=64)
    started = time.perf_counter()
    model = load_model(smollm2_path, LlamaForCausalLM, backend, torch.float32, torch.device("cpu"))
    print(f"cached load_model: {time.perf_counter() - started:.2f} s")
    return model, hf_model, tokenizer


def test_is_a_causal_lm(smollm2: tuple[Any, Any, Any]) -> None:
    model, _, _ = smollm2
    assert isinstance(model, CausalLM)
    assert not model.training
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.compute_logits(torch.zeros(2, 576)).shape == (2, 49152)


def test_varlen_prefill_and_decode_match_transformers(smollm2: tuple[Any, Any, Any]) -> None:
    model, hf_model, tokenizer = smollm2
    chat = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts = {
        "chat": tokenizer.encode(chat),
        "short": tokenizer.encode("The quick brown fox"),
        "long": tokenizer.encode(
            "Paged attention keeps the keys and values of every token in fixed-size blocks, "
            "so sequences of any length share one memory pool."
        ),
    }
    assert len({len(p) for p in prompts.values()}) == 3
    runner = PagedRunner(model, model.model.layers[0].self_attn.attention, num_blocks=64)
    split = len(prompts["long"]) // 2

    # Step 1: two whole prompts and the first chunk of the long one (its logits unused).
    step1 = runner.step(
        [("chat", prompts["chat"]), ("long", prompts["long"][:split]), ("short", prompts["short"])]
    )
    next_chat, next_short = int(step1[0].argmax()), int(step1[2].argmax())
    # Step 2: the long prompt's second chunk over cached context, and two decodes.
    step2 = runner.step(
        [("short", [next_short]), ("long", prompts["long"][split:]), ("chat", [next_chat])]
    )

    # Transformers runs each sequence alone; a prompt extended by its next token gives
    # both the prompt's last logits and the decode step's.
    chat_ref = hf_last_logits(hf_model, [*prompts["chat"], next_chat], count=2)
    short_ref = hf_last_logits(hf_model, [*prompts["short"], next_short], count=2)
    pairs = {
        "chat": (step1[0], chat_ref[0]),
        "short": (step1[2], short_ref[0]),
        "long": (step2[1], hf_last_logits(hf_model, prompts["long"])),
        "chat decode": (step2[2], chat_ref[1]),
        "short decode": (step2[0], short_ref[1]),
    }
    worst = 0.0
    for name, (ours, reference) in pairs.items():
        diff = (ours - reference).abs().max().item()
        worst = max(worst, diff)
        assert diff < LOGITS_ATOL, f"{name}: max |Δlogit| = {diff:.2e}"
        assert int(ours.argmax()) == int(reference.argmax()), name
    print(f"max |Δlogit| vs transformers: {worst:.2e}")


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(
            LlamaConfig(
                **SIZES,
                attention_bias=True,
                mlp_bias=True,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 50000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            ),
            id="llama-bias-untied-llama3-rope",
        ),
        pytest.param(
            LlamaConfig(
                **SIZES,
                tie_word_embeddings=True,
                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
            ),
            id="llama-tied-linear-rope",
        ),
        pytest.param(Qwen2Config(**SIZES, tie_word_embeddings=False), id="qwen2-qkv-bias"),
    ],
)
def test_tiny_random_models_match_transformers(config: Any) -> None:
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model = model_class(config)(hf_config=config, attention=make_backend(config, num_blocks=16))
    model.load_weights(hf_model.state_dict().items())
    runner = PagedRunner(model, model.model.layers[0].self_attn.attention, num_blocks=16)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (40, 3, 17)]
    ours = runner.step([(str(i), p) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(ours[i], hf_last_logits(hf_model, prompt), atol=1e-4, rtol=0)


def test_load_weights_rejects_unknown_and_missing_tensors() -> None:
    config = LlamaConfig(**SIZES)
    model = LlamaForCausalLM(hf_config=config, attention=make_backend(config, num_blocks=1))
    weights = dict(AutoModelForCausalLM.from_config(config).state_dict())
    with pytest.raises(ValueError, match="no place"):
        model.load_weights([*weights.items(), ("model.layers.0.self_attn.q_norm.weight", None)])
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 weights.*gate_up_proj"):
        model.load_weights(weights.items())
