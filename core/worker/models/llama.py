"""Llama-family decoders (Llama 2/3, SmolLM2, Mistral-style GQA, and Qwen2: Llama with
q/k/v biases), wired from plugserve.worker.layers.

Written against the AttentionBackend interface: the model works on one flat varlen batch
of tokens (no batch dimension, no padding) and hands each layer's q/k/v to the backend,
which owns the paged KV cache. The layers own their tensor-parallel sharding (a
ParallelContext with world_size > 1) and their weight loading: the checkpoint's q/k/v
and gate/up tensors go into the fused qkv_proj and gate_up_proj through
`packed_modules_mapping`.

bf16 on CPU, process_weights_after_loading packs every linear weight (layers.cpu_packing)
and runs each decoder layer as a FusedCpuDecoderLayer, or the whole stack as one
FusedCpuDecoder (models/llama_cpu.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from plugserve.interfaces import AttentionBackend
from plugserve.worker import cpu_linear, cpu_ops
from plugserve.worker.kernel_plan import KernelPlan
from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.checkpoint import PackedModulesMapping, load_checkpoint
from plugserve.worker.layers.cpu_packing import pack_for_cpu
from plugserve.worker.layers.direct_call import direct_call
from plugserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from plugserve.worker.layers.linear import Linear, RowParallelLinear
from plugserve.worker.layers.mlp import GatedMLP
from plugserve.worker.layers.norm import RMSNorm
from plugserve.worker.layers.rotary import (
    RopeStep,
    RotaryEmbedding,
    rope_inv_freq,
    rope_parameters,
)
from plugserve.worker.models.llama_cpu import FusedCpuDecoder, FusedCpuDecoderLayer
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext

# The layers lived in this module before plugserve.worker.layers: their names stay
# importable from here for one release (Linear, RMSNorm, RotaryEmbedding, ...).
__all__ = [
    "Linear",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaModel",
    "Qwen2ForCausalLM",
    "RMSNorm",
    "RopeStep",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "direct_call",
    "rope_inv_freq",
    "rope_parameters",
]


def _head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


@direct_call
class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        attention: AttentionBackend,
        parallel: ParallelContext,
        qkv_bias: bool,
    ):
        super().__init__()
        heads = hf_config.num_attention_heads
        # Llama's attention_bias covers q, k, v and o.
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        self.self_attn = Attention(
            hidden_size=hf_config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=_head_dim(hf_config),
            layer_idx=layer_idx,
            attention=attention,
            qkv_bias=qkv_bias,
            o_bias=attention_bias,
            parallel=parallel,
        )
        self.mlp = GatedMLP(
            hf_config.hidden_size,
            hf_config.intermediate_size,
            bias=bool(getattr(hf_config, "mlp_bias", False)),
            hidden_act=getattr(hf_config, "hidden_act", "silu"),
            parallel=parallel,
        )
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        rope: RopeStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (this layer's MLP output, the residual stream before it).

        The residual stream is carried apart from the sublayer outputs so that each add
        happens inside the next norm (one pass over the activations, in the fused op);
        the first layer gets the embeddings as x and no residual.
        """
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, rotary, rope)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        attention: AttentionBackend,
        parallel: ParallelContext,
        qkv_bias: bool,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, parallel
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, i, attention, parallel, qkv_bias)
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """interfaces.CausalLM for Llama-architecture checkpoints (HF names)."""

    # Checkpoint projection → (our fused projection, its shard id there).
    packed_modules_mapping: ClassVar[PackedModulesMapping] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        *,
        hf_config: Any,
        attention: AttentionBackend,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.parallel = parallel or NO_PARALLEL
        self.model = LlamaModel(hf_config, attention, self.parallel, self.qkv_bias(hf_config))
        theta, scaling = rope_parameters(hf_config)
        self.rotary = RotaryEmbedding(
            _head_dim(hf_config), hf_config.max_position_embeddings, theta, scaling
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Untied, the head holds the same vocabulary rows as this rank's embedding slice.
        self.lm_head: ParallelLMHead | None = (
            None
            if self.tie_word_embeddings
            else ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, self.parallel)
        )
        # What forward runs per layer: the modules, or their FusedCpuDecoderLayer.
        self.layer_fns: list[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = list(
            self.model.layers
        )
        # Or all of them at once, final norm included, where FusedCpuDecoder runs.
        self.decoder: FusedCpuDecoder | None = None
        self._arena: cpu_linear.WeightArena | None = None
        # bf16 on CPU: which kernel each row bucket's linears run (kernel_choice.py).
        self.kernel_plan: KernelPlan | None = None
        self.kernel_measurement: Any = None  # how it was chosen (kernel_choice.Measurement)

    @staticmethod
    def qkv_bias(hf_config: Any) -> bool:
        """Whether q, k and v have biases: in Llama, where attention_bias says so."""
        # Before Qwen2ForCausalLM had a class of its own this one built Qwen2's biases from
        # a Qwen2 config; it still does, for one release.
        return (
            bool(getattr(hf_config, "attention_bias", False))
            or getattr(hf_config, "model_type", "") == "qwen2"
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] long over the flat batch → hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, x.dtype)
        if self.decoder is not None and self.decoder.runs(x.shape[0]):
            return self.decoder(x, rope)
        residual = None
        for layer in self.layer_fns:
            x, residual = layer(x, residual, self.rotary, rope)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] → fp32 logits [N, vocab]. With tensor parallelism each rank
        computes its vocabulary slice and rank 0 gathers them; the others get None."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return self.parallel.gather_last_dim(head.logits(hidden_states), self.config.vocab_size)

    def weight_buffer(self) -> torch.Tensor | None:
        """The packed weights in one buffer (bf16 on CPU with cpu_gemm), else None."""
        return None if self._arena is None else self._arena.packed()

    def process_weights_after_loading(self) -> None:
        """bf16 on CPU: pack every linear weight for the CPU kernel, and run each layer as a
        FusedCpuDecoderLayer over the fused CPU ops (the final norm through them too).
        Elsewhere the model keeps ATen's ops and the weights as loaded."""
        embed = self.model.embed_tokens
        packing = pack_for_cpu(self, tied_head=embed if self.lm_head is None else None)
        self._arena = None if packing is None else packing.arena
        self.kernel_plan = None if packing is None else packing.plan
        self.kernel_measurement = None if packing is None else packing.measurement
        if cpu_ops.supported(embed.weight.dtype, embed.weight.device):
            self.rotary.use_fused_op()
            assert self.rotary.cos_sin is not None
            self.model.norm.fused = True
            fused = [
                FusedCpuDecoderLayer(layer, self.rotary.cos_sin) for layer in self.model.layers
            ]
            self.layer_fns = list(fused)
            if packing is not None and FusedCpuDecoder.supported(fused):
                self.decoder = FusedCpuDecoder(fused, self.model.norm.weight, packing.plan)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; raise on an unknown
        name, a wrong shape, and on parameters the checkpoint left unset."""
        load_checkpoint(self, weights, self.packed_modules_mapping, self._ignored)

    def _ignored(self, name: str) -> bool:
        # RoPE's inverse frequencies are derived state in HF's own model, not weights; and
        # some tied checkpoints store the shared matrix twice.
        return name.endswith("rotary_emb.inv_freq") or (
            self.lm_head is None and name == "lm_head.weight"
        )


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on q, k and v (never on o)."""

    @staticmethod
    def qkv_bias(hf_config: Any) -> bool:
        return True
