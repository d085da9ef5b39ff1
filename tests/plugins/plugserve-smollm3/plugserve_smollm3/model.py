"""SmolLM3: Llama's decoder layer, except that some layers attend without rotary position
embeddings ("NoPE": q and k enter attention as projected). The config says which:
`no_rope_layers[i]` is 1 where layer i rotates and 0 where it does not (every fourth
layer in SmolLM3-3B). With `use_sliding_window`, the layers `layer_types` marks
"sliding_attention" (the NoPE ones) attend over the last `sliding_window` tokens only
(off in SmolLM3-3B): the model says so per layer in `attention_layers`, and the
attention backend applies it.

A model file only wires plugserve's shared layers (plugserve.worker.layers) onto its
decoder frame (plugserve.worker.models.decoder.DecoderForCausalLM), which brings the
embeddings, the tied or untied head, the layer loop, loading through the layers' weight
loaders and tensor parallelism: every layer built with the `parallel` it is given holds
its rank's shard (heads, intermediate slice, vocabulary rows), the NoPE layers as any.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plugserve.interfaces.model import FULL_ATTENTION, AttentionBackend, LayerAttention
from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.decoder_layer import PreNormDecoderLayer
from plugserve.worker.layers.direct_call import direct_call
from plugserve.worker.layers.mlp import GatedMLP
from plugserve.worker.layers.norm import RMSNorm
from plugserve.worker.layers.rotary import RopeStep, RotaryEmbedding
from plugserve.worker.models.decoder import DecoderForCausalLM, head_dim_of, num_kv_heads_of
from plugserve.worker.parallel import ParallelContext


class NoRotation(nn.Module):
    """What a NoPE layer's attention calls in place of the model's RotaryEmbedding: the
    same call, the q and k heads returned as projected."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def forward(self, qkv: torch.Tensor, step: RopeStep, num_heads: int) -> torch.Tensor:
        """The first num_heads heads of each row of qkv [T, >= heads * D] → [T, heads, D]."""
        return qkv[:, : num_heads * self.head_dim].reshape(-1, num_heads, self.head_dim)


@direct_call  # overrides forward, so marked again (direct_call's rule)
class NoPEDecoderLayer(PreNormDecoderLayer):
    """PreNormDecoderLayer whose attention does not rotate q and k."""

    def __init__(self, *layers: nn.Module, head_dim: int) -> None:
        super().__init__(*layers)  # type: ignore[arg-type]
        self.no_rotation = NoRotation(head_dim)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        rope: RopeStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(x, residual, self.no_rotation, rope)  # type: ignore[arg-type]


class SmolLM3ForCausalLM(DecoderForCausalLM):
    """interfaces.model.CausalLM for SmolLM3 checkpoints (Hugging Face names), tied or untied.

    The checkpoint's q/k/v and gate/up projections load into the fused layers through
    DecoderForCausalLM's packed_modules_mapping (q_proj → qkv_proj shard "q", ...)."""

    @classmethod
    def attention_layers(cls, hf_config: Any) -> list[LayerAttention]:
        """A window on the layers layer_types marks sliding, where use_sliding_window
        (transformers' SmolLM3Attention reads the same two settings)."""
        window = hf_config.sliding_window if hf_config.use_sliding_window else None
        return [
            LayerAttention(sliding_window=window)
            if window is not None and kind == "sliding_attention"
            else FULL_ATTENTION
            for kind in hf_config.layer_types
        ]

    def build_layer(
        self, hf_config: Any, layer_idx: int, attention: AttentionBackend, parallel: ParallelContext
    ) -> PreNormDecoderLayer:
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        head_dim = head_dim_of(hf_config)
        bias = bool(hf_config.attention_bias)  # on q, k, v and o alike, as Llama's
        layers = (
            Attention(
                hidden_size=hidden,
                num_heads=hf_config.num_attention_heads,
                num_kv_heads=num_kv_heads_of(hf_config),
                head_dim=head_dim,
                layer_idx=layer_idx,
                attention=attention,
                qkv_bias=bias,
                o_bias=bias,
                parallel=parallel,
            ),
            GatedMLP(
                hidden,
                hf_config.intermediate_size,
                bias=bool(hf_config.mlp_bias),
                hidden_act=hf_config.hidden_act,
                parallel=parallel,
            ),
            RMSNorm(hidden, eps),
            RMSNorm(hidden, eps),
        )
        if hf_config.no_rope_layers[layer_idx]:
            return PreNormDecoderLayer(*layers)
        return NoPEDecoderLayer(*layers, head_dim=head_dim)

    def process_weights_after_loading(self) -> None:
        self.log_generic_path("the fused bf16 CPU decoder rotates q and k in every layer")
