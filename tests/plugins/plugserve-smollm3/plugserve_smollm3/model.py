"""SmolLM3: Llama's decoder layer, except that some layers attend without rotary position
embeddings ("NoPE": q and k enter attention as projected, the shared Attention layer built
with `rotate=False`). The config says which: `no_rope_layers[i]` is 1 where layer i
rotates and 0 where it does not (every fourth layer in SmolLM3-3B). With
`use_sliding_window`, the layers `layer_types` marks "sliding_attention" (the NoPE ones)
attend over the last `sliding_window` tokens only (off in SmolLM3-3B): the model says so
per layer in `attention_layers`, and the attention backend applies it.

A model file only wires plugserve's shared layers (plugserve.worker.layers) onto its
decoder frame (plugserve.worker.models.decoder.DecoderForCausalLM), which brings the
embeddings, the tied or untied head, the layer loop, loading through the layers' weight
loaders and tensor parallelism: every layer built with the `parallel` it is given holds
its rank's shard (heads, intermediate slice, vocabulary rows), the NoPE layers as any.
"""

from __future__ import annotations

from typing import Any

from plugserve.interfaces.model import FULL_ATTENTION, AttentionBackend, LayerAttention
from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.decoder_layer import PreNormDecoderLayer
from plugserve.worker.layers.mlp import GatedMLP
from plugserve.worker.layers.norm import RMSNorm
from plugserve.worker.models.decoder import DecoderForCausalLM, head_dim_of, num_kv_heads_of
from plugserve.worker.parallel import ParallelContext


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
        bias = bool(hf_config.attention_bias)  # on q, k, v and o alike, as Llama's
        return PreNormDecoderLayer(
            Attention(
                hidden_size=hidden,
                num_heads=hf_config.num_attention_heads,
                num_kv_heads=num_kv_heads_of(hf_config),
                head_dim=head_dim_of(hf_config),
                layer_idx=layer_idx,
                attention=attention,
                qkv_bias=bias,
                o_bias=bias,
                parallel=parallel,
                # no_rope_layers[i] is 0 where layer i attends without rotation (NoPE).
                rotate=bool(hf_config.no_rope_layers[layer_idx]),
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
