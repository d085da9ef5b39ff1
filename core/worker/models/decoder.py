"""What every decoder-only architecture shares, so that a model file only wires layers.

A model is embeddings → decoder layers → final norm → LM head, on one flat varlen batch
of tokens (interfaces.model.CausalLM). `DecoderForCausalLM` holds that frame: the tied or
untied vocab-parallel head, the rotary table, the layer loop (each layer maps
(x, residual) → (its output, the residual stream before it), so every residual add
happens inside the next norm), logits gathered over tensor-parallel ranks, and loading
Hugging Face names through `packed_modules_mapping` and the parameters' weight loaders.
How each linear layer runs is its linear method's business (worker/linear_methods.py),
whatever the architecture: the model file never chooses it. After loading, model passes
(worker/model_passes.py) may change how the layers run through the frame
(interfaces.model.DecoderFrame): what the loop calls per layer (`layer_fns`), or the
whole stack and final norm as one replacement (`install_stack`).

A subclass builds its layers in `build_layer` and overrides a hook where its family
differs (Gemma scales the embeddings, soft-caps the logits, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from plugserve.capabilities import has_kernel_plan, supports_weight_buffer
from plugserve.interfaces.model import (
    FULL_ATTENTION,
    AttentionBackend,
    LayerAttention,
    WholeStack,
)
from plugserve.worker.layers.checkpoint import PackedModulesMapping, load_checkpoint
from plugserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from plugserve.worker.layers.norm import RMSNorm
from plugserve.worker.layers.rotary import RopeStep, RotaryEmbedding, rope_parameters
from plugserve.worker.linear_methods import linear_methods_of
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext

# The fused projections of the shared layers (layers.attention.Attention and
# layers.mlp.GatedMLP): checkpoint projection → (our module, its shard id there).
FUSED_QKV_AND_GATE_UP: PackedModulesMapping = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def head_dim_of(hf_config: Any) -> int:
    """head_dim from the config where it says (Qwen3, Gemma: not hidden / heads)."""
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


def num_kv_heads_of(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


class DecoderModel(nn.Module):
    """The HF `model.` prefix: embed_tokens, layers, norm."""

    def __init__(
        self,
        embed_tokens: VocabParallelEmbedding,
        layers: Iterable[nn.Module],
        norm: nn.Module,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class DecoderForCausalLM(nn.Module):
    """interfaces.model.CausalLM for a decoder-only family; subclasses give `build_layer`."""

    packed_modules_mapping: ClassVar[PackedModulesMapping] = FUSED_QKV_AND_GATE_UP

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
        self.model = DecoderModel(
            VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, self.parallel),
            (
                self.build_layer(hf_config, i, attention, self.parallel)
                for i in range(hf_config.num_hidden_layers)
            ),
            self.build_norm(hf_config),
        )
        self.rotary = self.build_rotary(hf_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Untied, the head holds the same vocabulary rows as this rank's embedding slice.
        self.lm_head: ParallelLMHead | None = (
            None
            if self.tie_word_embeddings
            else ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, self.parallel)
        )
        # What forward runs per layer: the modules, or what a model pass put in their
        # place; and where a pass installed one, the whole stack as one (install_stack).
        self.layer_fns: list[Any] = list(self.model.layers)
        self.whole_stack: WholeStack | None = None

    # ------------------------------------------------------------------ what a family gives

    def build_layer(
        self, hf_config: Any, layer_idx: int, attention: AttentionBackend, parallel: ParallelContext
    ) -> nn.Module:
        """One decoder layer: forward(x, residual, rotary, rope) → (out, residual)."""
        raise NotImplementedError

    @classmethod
    def attention_layers(cls, hf_config: Any) -> list[LayerAttention]:
        """What each layer's attention computes (capabilities.HasLayerAttention): full
        causal at 1/sqrt(head_dim) unless the family says otherwise (sliding windows,
        soft-capping, another scale)."""
        return [FULL_ATTENTION] * hf_config.num_hidden_layers

    def build_norm(self, hf_config: Any) -> nn.Module:
        """The final norm (with `add_and_norm(x, residual)`)."""
        return RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def build_rotary(self, hf_config: Any) -> RotaryEmbedding:
        theta, scaling = rope_parameters(hf_config)
        return RotaryEmbedding(
            head_dim_of(hf_config), hf_config.max_position_embeddings, theta, scaling
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    # ------------------------------------------------------------------ interfaces.model.DecoderFrame

    @property
    def layers(self) -> Sequence[nn.Module]:
        return self.model.layers

    @property
    def final_norm(self) -> nn.Module:
        return self.model.norm

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def install_stack(self, stack: WholeStack | None) -> None:
        self.whole_stack = stack

    # ------------------------------------------------------------------ interfaces.model.CausalLM

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] long over the flat batch → hidden states [T, hidden]."""
        x = self.embed(input_ids)
        rope = self.rotary.prepare(positions, x.dtype)
        stack = self.whole_stack
        if stack is not None and stack.runs(x.shape[0]):
            return stack(x, rope)
        return self.run_layers(x, rope)

    def run_layers(self, x: torch.Tensor, rope: RopeStep) -> torch.Tensor:
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

    def tied_lm_head(self) -> VocabParallelEmbedding | None:
        """The embedding, where it is also the LM head (capabilities.HasTiedLmHead)."""
        return self.model.embed_tokens if self.lm_head is None else None

    @property
    def kernel_plan(self) -> Any:
        """The kernel plan the linears' method measured, where one did
        (capabilities.HasKernelPlan), else None."""
        plans = (m.kernel_plan for m in linear_methods_of(self) if has_kernel_plan(m))
        return next((plan for plan in plans if plan is not None), None)

    def weight_buffer(self) -> torch.Tensor | None:
        """The packed weights in one buffer (bf16 on CPU with cpu_gemm), else None."""
        buffers = (m.weight_buffer() for m in linear_methods_of(self) if supports_weight_buffer(m))
        return next((buffer for buffer in buffers if buffer is not None), None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; raise on an unknown
        name, a wrong shape, and on parameters the checkpoint left unset."""
        load_checkpoint(self, weights, self.packed_modules_mapping, self.ignored_weight)

    def ignored_weight(self, name: str) -> bool:
        """Checkpoint tensors that are not weights of ours."""
        # RoPE's inverse frequencies are derived state in HF's own model; some tied
        # checkpoints store the shared matrix twice.
        return name.endswith("rotary_emb.inv_freq") or (
            self.lm_head is None and name == "lm_head.weight"
        )
