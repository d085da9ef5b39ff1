"""MistralForCausalLM keeps Llama's fused bf16 CPU decoder with what Mistral adds: head_dim
from the config (not hidden_size / num_heads) and a sliding window on every layer, which
the attention backend applies inside the decoder's one call per layer. The whole model
against transformers: tests/correctness/architecture_cases/mistral.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_llama import BLOCK_SIZE, SIZES, PagedRunner
from transformers import AutoModelForCausalLM, MistralConfig

from plugserve.interfaces.model import FULL_ATTENTION, AttentionSpec, LayerAttention
from plugserve.worker import cpu_ops
from plugserve.worker.linear_methods import LinearMethodChooser, give_linear_methods
from plugserve.worker.model_loader import finish_loading
from plugserve.worker.models.llama_cpu import FusedCpuDecoder
from plugserve.worker.models.mistral import MistralForCausalLM
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention


def mistral_config(**options: Any) -> MistralConfig:
    """test_llama.py's sizes, with head_dim 32 where hidden_size / num_heads is 16."""
    return MistralConfig(**SIZES, head_dim=32, **options)


def test_every_layer_slides_over_the_configs_window_or_none() -> None:
    windowed = mistral_config(sliding_window=12)
    assert MistralForCausalLM.attention_layers(windowed) == [LayerAttention(sliding_window=12)] * 2
    assert (
        MistralForCausalLM.attention_layers(mistral_config(sliding_window=None))
        == [FULL_ATTENTION] * 2
    )


def bf16_mistral(config: Any, weights: dict[str, torch.Tensor]) -> MistralForCausalLM:
    """The model in bf16 over its own bf16 backend, which holds the layers' windows."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        backend = TorchPagedAttention(
            spec=AttentionSpec(
                num_layers=config.num_hidden_layers,
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                block_size=BLOCK_SIZE,
                dtype=torch.bfloat16,
                device=torch.device("cpu"),
                layers=tuple(MistralForCausalLM.attention_layers(config)),
            )
        )
        backend.allocate_kv_cache(16)
        model = MistralForCausalLM(hf_config=config, attention=backend)
        chooser = LinearMethodChooser(dtype=torch.bfloat16, device=torch.device("cpu"))
        give_linear_methods(model, chooser)
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(weights.items())
    return model


@pytest.mark.skipif(cpu_ops.unavailable_reason() is not None, reason="cpu_ops.cpp not built")
@pytest.mark.usefixtures("own_kernel")
def test_bf16_on_cpu_runs_the_fused_decoder_with_head_dim_32_and_a_window() -> None:
    config = mistral_config(sliding_window=8)
    torch.manual_seed(0)
    weights = AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict()
    plain, fast = bf16_mistral(config, weights), bf16_mistral(config, weights)
    finish_loading(fast)
    assert isinstance(fast.decoder, FusedCpuDecoder)

    def run(model: MistralForCausalLM) -> torch.Tensor:
        """A mixed prefill, then two decode steps, each request's last logits."""
        runner = PagedRunner(model, model.model.layers[0].self_attn.attention, 16)
        prompts = [
            torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
            for n in (40, 3, 20)
        ]
        steps = [runner.step([(str(i), p.tolist()) for i, p in enumerate(prompts)])]
        for token in (7, 9):
            steps.append(runner.step([(str(i), [token]) for i in range(len(prompts))]))
        return torch.cat(steps)

    torch.testing.assert_close(run(fast), run(plain), atol=0.05, rtol=0.05)
