"""Mixtral: Llama's attention (GQA, RoPE, no biases; every layer over the last
`sliding_window` positions where the config sets one, None in the released models) with
a mixture of experts as every layer's MLP.

Routing: softmax over all experts in fp32, the top `num_experts_per_tok`, always
renormalized over them; the fp32 weights scale the experts' outputs and the products
are rounded to the activations' dtype (transformers' MixtralTopKRouter and
MixtralExperts). Checkpoints name the block `block_sparse_moe` and an expert's
projections w1 (gate), w3 (up), w2 (down); transformers 5's module names (`mlp`, the
experts stacked) load too.
"""

from __future__ import annotations

from typing import Any

from plugserve.interfaces.model import AttentionBackend, LayerAttention
from plugserve.worker.layers.decoder_layer import PreNormDecoderLayer
from plugserve.worker.layers.moe import MIXTRAL_NAMES, FusedMoE
from plugserve.worker.models.llama import llama_layer
from plugserve.worker.models.moe_decoder import MoeDecoderForCausalLM
from plugserve.worker.parallel import ParallelContext


class MixtralForCausalLM(MoeDecoderForCausalLM):
    """interfaces.model.CausalLM for Mixtral checkpoints (HF names)."""

    expert_names = MIXTRAL_NAMES

    @classmethod
    def attention_layers(cls, hf_config: Any) -> list[LayerAttention]:
        window = getattr(hf_config, "sliding_window", None)
        return [LayerAttention(sliding_window=window)] * hf_config.num_hidden_layers

    def build_layer(
        self, hf_config: Any, layer_idx: int, attention: AttentionBackend, parallel: ParallelContext
    ) -> PreNormDecoderLayer:
        moe = FusedMoE(
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            renormalize=True,
            weigh_in_fp32=True,
            hidden_act=hf_config.hidden_act,
            parallel=parallel,
        )
        return llama_layer(hf_config, layer_idx, attention, parallel, qkv_bias=False, mlp=moe)
