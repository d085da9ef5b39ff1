"""Mistral: Llama's layer, with no biases, head_dim from the config (Mistral-Nemo: 128,
not hidden_size / num_heads) and, where the config sets `sliding_window` (Mistral 7B
v0.1: 4096; later versions None), every layer attending over that many positions.

It is LlamaForCausalLM otherwise: the window is the attention backend's to apply
(AttentionSpec.layers), inside the one call each layer makes to it.
"""

from __future__ import annotations

from typing import Any

from plugserve.interfaces.model import LayerAttention
from plugserve.worker.models.llama import LlamaForCausalLM


def sliding_window_layers(hf_config: Any) -> list[LayerAttention]:
    """Every layer over the last `sliding_window` positions where the config sets one
    (Mistral, Phi-3: one window for all layers), else over the whole context."""
    window = getattr(hf_config, "sliding_window", None)
    return [LayerAttention(sliding_window=window)] * hf_config.num_hidden_layers


class MistralForCausalLM(LlamaForCausalLM):
    """interfaces.model.CausalLM for Mistral checkpoints (HF names), tied or untied head."""

    @classmethod
    def attention_layers(cls, hf_config: Any) -> list[LayerAttention]:
        return sliding_window_layers(hf_config)
