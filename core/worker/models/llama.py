"""Llama-family decoders (Llama 2/3, SmolLM2) and Qwen2 (Llama with q/k/v biases), on the
shared layers (plugserve.worker.layers) and frame (models.decoder).

bf16 on CPU, after loading each decoder layer runs as a FusedCpuDecoderLayer, or the
whole stack as one FusedCpuDecoder (models/llama_cpu.py), over the packed weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plugserve.interfaces.model import AttentionBackend
from plugserve.worker import cpu_ops
from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.decoder_layer import PreNormDecoderLayer
from plugserve.worker.layers.mlp import GatedMLP
from plugserve.worker.layers.norm import RMSNorm
from plugserve.worker.models.decoder import DecoderForCausalLM, head_dim_of, num_kv_heads_of
from plugserve.worker.models.llama_cpu import FusedCpuDecoder, FusedCpuDecoderLayer
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

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # All layers at once, final norm included, where FusedCpuDecoder runs.
        self.decoder: FusedCpuDecoder | None = None

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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        rope = self.rotary.prepare(positions, x.dtype)
        if self.decoder is not None and self.decoder.runs(x.shape[0]):
            return self.decoder(x, rope)
        return self.run_layers(x, rope)

    def process_weights_after_loading(self) -> None:
        """bf16 on CPU: run each layer as a FusedCpuDecoderLayer over the fused CPU ops (the
        final norm through them too), its linears through what their method installed,
        and the whole stack as one where every linear is packed for cpu_gemm. Elsewhere
        the model keeps ATen's ops."""
        embed = self.model.embed_tokens
        if cpu_ops.supported(embed.weight.dtype, embed.weight.device) and self._silu_mlps():
            self.rotary.use_fused_op()
            assert self.rotary.cos_sin is not None
            self.model.norm.fused = True
            fused = [
                FusedCpuDecoderLayer(layer, self.rotary.cos_sin) for layer in self.model.layers
            ]
            self.layer_fns = list(fused)
            plan = self.kernel_plan
            if plan is not None and FusedCpuDecoder.supported(fused):
                self.decoder = FusedCpuDecoder(fused, self.model.norm.weight, plan)

    def _silu_mlps(self) -> bool:
        """Whether every MLP computes SiLU, the fused CPU layers' only activation (the
        shared GatedMLP takes others); where not, says so and keeps the modules."""
        acts = {layer.mlp.hidden_act for layer in self.model.layers}
        if acts <= {"silu"}:
            return True
        self.log_generic_path(f"the fused bf16 CPU decoder computes SiLU, not {sorted(acts)}")
        return False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on q, k and v (never on o)."""

    @staticmethod
    def qkv_bias(hf_config: Any) -> bool:
        return True
