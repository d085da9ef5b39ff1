"""Qwen3-MoE: Qwen3's layer (q/k RMSNorm per head before RoPE, no q/k/v bias, head_dim
from the config; with `use_sliding_window`, every layer over the last `sliding_window`
positions, as transformers' Qwen3-MoE does) with a mixture of experts as the MLP of every `decoder_sparse_step`-th
layer not listed in `mlp_only_layers` (a dense GatedMLP of `intermediate_size` there).

Routing: softmax over all experts in fp32, the top `num_experts_per_tok`, renormalized
over them where `norm_topk_prob`, the weights rounded to the activations' dtype before
they scale the experts' outputs (transformers' Qwen3MoeTopKRouter and Qwen3MoeExperts).
"""

from __future__ import annotations

from typing import Any

from plugserve.interfaces.model import AttentionBackend, LayerAttention
from plugserve.worker.layers.decoder_layer import PreNormDecoderLayer
from plugserve.worker.layers.moe import QWEN_MOE_NAMES, FusedMoE
from plugserve.worker.models.llama import llama_layer
from plugserve.worker.models.moe_decoder import MoeDecoderForCausalLM
from plugserve.worker.parallel import ParallelContext


def is_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx`'s MLP is the mixture of experts (transformers' rule)."""
    return (
        layer_idx not in (hf_config.mlp_only_layers or ())
        and hf_config.num_experts > 0
        and (layer_idx + 1) % hf_config.decoder_sparse_step == 0
    )


class Qwen3MoeForCausalLM(MoeDecoderForCausalLM):
    """interfaces.model.CausalLM for Qwen3-MoE checkpoints (HF names), tied or untied head."""

    expert_names = QWEN_MOE_NAMES

    @classmethod
    def attention_layers(cls, hf_config: Any) -> list[LayerAttention]:
        # The released models leave use_sliding_window off, and sliding_window (4096 in
        # their configs) then means nothing.
        sliding = getattr(hf_config, "use_sliding_window", False)
        window = hf_config.sliding_window if sliding else None
        return [LayerAttention(sliding_window=window)] * hf_config.num_hidden_layers

    def build_layer(
        self, hf_config: Any, layer_idx: int, attention: AttentionBackend, parallel: ParallelContext
    ) -> PreNormDecoderLayer:
        moe = None
        if is_sparse_layer(hf_config, layer_idx):
            moe = FusedMoE(
                hidden_size=hf_config.hidden_size,
                intermediate_size=hf_config.moe_intermediate_size,
                num_experts=hf_config.num_experts,
                top_k=hf_config.num_experts_per_tok,
                renormalize=bool(hf_config.norm_topk_prob),
                weigh_in_fp32=False,
                hidden_act=hf_config.hidden_act,
                parallel=parallel,
            )
        return llama_layer(
            hf_config, layer_idx, attention, parallel, qkv_bias=False, qk_norm=True, mlp=moe
        )
