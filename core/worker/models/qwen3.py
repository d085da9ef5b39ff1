"""Qwen3 (dense): Llama's layer with an RMSNorm over each q and each k head before RoPE,
no q/k/v biases, and head_dim from the config (128 in the released models, whatever
hidden_size / num_heads is).
"""

from __future__ import annotations

from typing import Any

from plugserve.interfaces.model import AttentionBackend
from plugserve.model_files import CheckpointError
from plugserve.worker.layers.decoder_layer import PreNormDecoderLayer
from plugserve.worker.models.decoder import DecoderForCausalLM
from plugserve.worker.models.llama import llama_layer
from plugserve.worker.parallel import ParallelContext


class Qwen3ForCausalLM(DecoderForCausalLM):
    """interfaces.model.CausalLM for Qwen3 checkpoints (HF names), tied or untied head."""

    def __init__(self, *, hf_config: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "use_sliding_window", False):
            raise CheckpointError(
                "Qwen3ForCausalLM with use_sliding_window is not supported (the released "
                "Qwen3 models attend over the whole context)"
            )
        super().__init__(hf_config=hf_config, **kwargs)

    def build_layer(
        self, hf_config: Any, layer_idx: int, attention: AttentionBackend, parallel: ParallelContext
    ) -> PreNormDecoderLayer:
        return llama_layer(hf_config, layer_idx, attention, parallel, qkv_bias=False, qk_norm=True)
