"""Llama-family decoders (Llama 2/3, SmolLM2) and Qwen2 (Llama with q/k/v biases), on the
shared layers (plugserve.worker.layers) and frame (models.decoder)."""

from __future__ import annotations

from typing import Any

from torch import nn

from plugserve.interfaces.model import AttentionBackend
from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.decoder_layer import PreNormDecoderLayer
from plugserve.worker.layers.mlp import GatedMLP
from plugserve.worker.layers.norm import RMSNorm
from plugserve.worker.models.decoder import DecoderForCausalLM, head_dim_of, num_kv_heads_of
from plugserve.worker.parallel import ParallelContext


def llama_layer(
    hf_config: Any,
    layer_idx: int,
    attention: AttentionBackend,
    parallel: ParallelContext,
    *,
    qkv_bias: bool,
    qk_norm: bool = False,
    mlp: nn.Module | None = None,
) -> PreNormDecoderLayer:
    """The Llama layer with the options its relatives switch: q/k/v biases (Qwen2), a
    q/k norm (Qwen3), another MLP in place of the dense GatedMLP (a mixture of experts:
    Mixtral, Qwen3-MoE). Llama's own attention_bias covers q, k, v and o."""
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    eps = hf_config.rms_norm_eps
    return PreNormDecoderLayer(
        Attention(
            hidden_size=hf_config.hidden_size,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=num_kv_heads_of(hf_config),
            head_dim=head_dim_of(hf_config),
            layer_idx=layer_idx,
            attention=attention,
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias,
            parallel=parallel,
            qk_norm_eps=eps if qk_norm else None,
        ),
        mlp
        if mlp is not None
        else GatedMLP(
            hf_config.hidden_size,
            hf_config.intermediate_size,
            bias=bool(getattr(hf_config, "mlp_bias", False)),
            hidden_act=getattr(hf_config, "hidden_act", "silu"),
            parallel=parallel,
        ),
        RMSNorm(hf_config.hidden_size, eps),
        RMSNorm(hf_config.hidden_size, eps),
    )


class LlamaForCausalLM(DecoderForCausalLM):
    """interfaces.model.CausalLM for Llama-architecture checkpoints (HF names)."""

    def build_layer(
        self, hf_config: Any, layer_idx: int, attention: AttentionBackend, parallel: ParallelContext
    ) -> PreNormDecoderLayer:
        return llama_layer(
            hf_config, layer_idx, attention, parallel, qkv_bias=self.qkv_bias(hf_config)
        )

    @staticmethod
    def qkv_bias(hf_config: Any) -> bool:
        """Whether q, k and v have biases beyond attention_bias's: Llama's have none."""
        return False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on q, k and v (never on o)."""

    @staticmethod
    def qkv_bias(hf_config: Any) -> bool:
        return True
