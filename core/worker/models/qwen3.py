"""Qwen3 (dense), wired from plugserve.worker.layers: Llama's decoder with an RMSNorm over
each q and each k head before RoPE, no q/k/v biases, and head_dim from the config (128
in the released models, whatever hidden_size / num_heads is).

Generic path only: the fused bf16 CPU decoder (models/llama_cpu.py) has no q/k norm, so
Qwen3 runs every layer through the modules below, in any dtype and on any device; the
start-up log says so where Llama would have switched to the fused path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from plugserve.interfaces import AttentionBackend
from plugserve.model_files import CheckpointError
from plugserve.worker import cpu_ops
from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.checkpoint import PackedModulesMapping, load_checkpoint
from plugserve.worker.layers.direct_call import direct_call
from plugserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from plugserve.worker.layers.mlp import GatedMLP
from plugserve.worker.layers.norm import RMSNorm
from plugserve.worker.layers.rotary import RopeStep, RotaryEmbedding, rope_parameters
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext

logger = logging.getLogger(__name__)


def _head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


@direct_call
class Qwen3DecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        attention: AttentionBackend,
        parallel: ParallelContext,
    ) -> None:
        super().__init__()
        heads = hf_config.num_attention_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        self.self_attn = Attention(
            hidden_size=hf_config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=_head_dim(hf_config),
            layer_idx=layer_idx,
            attention=attention,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            parallel=parallel,
            qk_norm_eps=hf_config.rms_norm_eps,
        )
        self.mlp = GatedMLP(
            hf_config.hidden_size,
            hf_config.intermediate_size,
            bias=False,
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
        """(x, residual) → (this layer's MLP output, the residual stream before it); the
        first layer gets the embeddings as x and no residual (as LlamaDecoderLayer)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, rotary, rope)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class Qwen3Model(nn.Module):
    def __init__(
        self, hf_config: Any, attention: AttentionBackend, parallel: ParallelContext
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, parallel
        )
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(hf_config, i, attention, parallel)
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """interfaces.CausalLM for Qwen3 checkpoints (HF names), tied or untied head."""

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
        if getattr(hf_config, "use_sliding_window", False):
            raise CheckpointError(
                "Qwen3ForCausalLM with use_sliding_window is not supported (the released "
                "Qwen3 models attend over the whole context)"
            )
        self.config = hf_config
        self.parallel = parallel or NO_PARALLEL
        self.model = Qwen3Model(hf_config, attention, self.parallel)
        theta, scaling = rope_parameters(hf_config)
        self.rotary = RotaryEmbedding(
            _head_dim(hf_config), hf_config.max_position_embeddings, theta, scaling
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head: ParallelLMHead | None = (
            None
            if self.tie_word_embeddings
            else ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, self.parallel)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] long over the flat batch → hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, self.rotary, rope)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] → fp32 logits [N, vocab]; under tensor parallelism rank 0
        gathers the vocabulary slices and the other ranks get None."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return self.parallel.gather_last_dim(head.logits(hidden_states), self.config.vocab_size)

    def process_weights_after_loading(self) -> None:
        """Nothing to re-lay out: the weights stay as loaded. Where Llama would switch to
        the fused bf16 CPU decoder, say that Qwen3 does not."""
        weight = self.model.embed_tokens.weight
        if cpu_ops.supported(weight.dtype, weight.device):
            logger.info(
                "Qwen3ForCausalLM runs on the generic path (ATen ops, weights as loaded): "
                "the fused bf16 CPU decoder has no q/k norm"
            )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; raise on an unknown
        name, a wrong shape, and on parameters the checkpoint left unset."""
        load_checkpoint(self, weights, self.packed_modules_mapping, self._ignored)

    def _ignored(self, name: str) -> bool:
        # Tied checkpoints may store the shared matrix twice.
        return name.endswith("rotary_emb.inv_freq") or (
            self.lm_head is None and name == "lm_head.weight"
        )
