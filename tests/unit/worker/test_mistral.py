"""What MistralForCausalLM adds to Llama's layers: head_dim from the config (not
hidden_size / num_heads) and a sliding window on every layer, which the attention backend
applies. The fused bf16 CPU decoder over them: tests/unit/cpu_bf16/test_fused_decoder.py;
the whole model against transformers: tests/correctness/architecture_cases/mistral.py."""

from __future__ import annotations

from typing import Any

from transformers import MistralConfig

from plugserve.interfaces.model import FULL_ATTENTION, LayerAttention
from plugserve.worker.models.mistral import MistralForCausalLM
from tests.model_support import SIZES


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
