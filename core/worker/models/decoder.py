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

Under pipeline parallelism (`stage=`, a worker.parallel.PipelineStage) the frame holds
only its stage's layers, the embeddings only on the first stage (and on the last where
the head is tied to them), the final norm and the head only on the last; the others are
`AbsentLayer` placeholders, so checkpoint names keep their layer numbers and the
stage's weights load by them. `forward_stage` runs the stage: it takes the previous
stage's `StageActivations` (hidden states and residual stream) and returns its own, or
the final hidden states on the last stage.

Built with `lm_head=False` (a decoder served for pooling: Qwen3-Embedding) the frame
holds no head and loads none; checkpoints saved from the base model (no `model.` prefix
on their names) load into it as they are.

A subclass builds its layers in `build_layer` and overrides a hook where its family
differs (Gemma scales the embeddings, soft-caps the logits, rotates some layers by
another table in `run_layers`, ...).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
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
from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.checkpoint import PackedModulesMapping, load_checkpoint
from plugserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from plugserve.worker.layers.norm import RMSNorm
from plugserve.worker.layers.rotary import RopeStep, RotaryEmbedding, rope_parameters
from plugserve.worker.linear_methods import linear_methods_of
from plugserve.worker.parallel import NO_PARALLEL, WHOLE_MODEL, ParallelContext, PipelineStage

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


_LAYER_WEIGHT = re.compile(r"model\.layers\.(\d+)\.")
# What a base model's checkpoint names its tensors from (transformers' DecoderModel).
_BASE_MODEL_ROOTS = ("layers.", "embed_tokens.", "norm.")


def with_model_prefix(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names as the causal LM's: a checkpoint saved from the base model
    (transformers' Qwen3Model, as Qwen3-Embedding's are, whatever its config.json's
    architectures say) names its tensors without the `model.` prefix. Other names pass
    as they are, so an unknown one is reported as the checkpoint spells it."""
    for name, tensor in weights:
        yield (f"model.{name}" if name.startswith(_BASE_MODEL_ROOTS) else name), tensor


@dataclass
class StageActivations:
    """What a non-final pipeline stage hands the next: the last layer's output and the
    residual stream before it, [tokens, hidden] each (the next layer's norm adds them)."""

    hidden: torch.Tensor
    residual: torch.Tensor


class AbsentLayer(nn.Module):
    """A module another pipeline stage holds: no parameters, never called."""

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("this module lives on another pipeline stage")


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
    # capabilities.BuildsWithoutLmHead: `lm_head=False` for a pooling runner.
    builds_without_lm_head: ClassVar[bool] = True

    def __init__(
        self,
        *,
        hf_config: Any,
        attention: AttentionBackend,
        parallel: ParallelContext | None = None,
        stage: PipelineStage | None = None,
        lm_head: bool = True,
    ) -> None:
        super().__init__()
        self.config = hf_config
        # False: built to pool (capabilities.BuildsWithoutLmHead), the final hidden
        # states being the output; no head is held, tied or not.
        self.with_lm_head = lm_head
        self.parallel = parallel or NO_PARALLEL
        num_layers = hf_config.num_hidden_layers
        self.stage = stage or WHOLE_MODEL
        self.stage_layers = range(self.stage.first_layer, self.stage.end_layer or num_layers)
        if self.stage.is_last and self.stage_layers.stop != num_layers:
            raise ValueError(
                f"the last pipeline stage must run through layer {num_layers - 1}; "
                f"it ends at {self.stage_layers.stop - 1}"
            )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        holds_embedding = self.stage.is_first or (self.stage.is_last and self.tie_word_embeddings)
        self.model = DecoderModel(
            VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, self.parallel)
            if holds_embedding
            else AbsentLayer(),
            (
                self._build_stage_layer(hf_config, i, attention)
                if self.stage.holds_layer(i)
                else AbsentLayer()
                for i in range(num_layers)
            ),
            self.build_norm(hf_config) if self.stage.is_last else AbsentLayer(),
        )
        self.rotary = self.build_rotary(hf_config)
        # Untied, the head holds the same vocabulary rows as this rank's embedding slice.
        self.lm_head: ParallelLMHead | None = (
            ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, self.parallel)
            if lm_head and self.stage.is_last and not self.tie_word_embeddings
            else None
        )
        # What forward runs per layer: the modules, or what a model pass put in their
        # place; and where a pass installed one, the whole stack as one (install_stack).
        self.layer_fns: list[Any] = list(self.layers)
        self.whole_stack: WholeStack | None = None

    def _build_stage_layer(self, hf_config: Any, layer_idx: int, attention: Any) -> nn.Module:
        """Layer `layer_idx`, built by its global number (a family's per-layer choices
        follow it), its attention reading the KV cache by its place in this stage: the
        stage's attention backend holds its own layers' cache only."""
        layer = self.build_layer(hf_config, layer_idx, attention, self.parallel)
        for module in layer.modules():
            if isinstance(module, Attention):
                module.layer_idx -= self.stage.first_layer
        return layer

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
        """This stage's decoder layers (every layer without pipeline parallelism)."""
        return self.model.layers[self.stage_layers.start : self.stage_layers.stop]

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
        stack = self.whole_stack
        if stack is not None and stack.runs(x.shape[0]):
            return stack(x, self.rotary.prepare(positions, x.dtype))
        return self.final_hidden(*self.run_layers(x, None, positions))

    def forward_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous: StageActivations | None,
    ) -> torch.Tensor | StageActivations:
        """One pipeline stage (capabilities.SupportsPipelineStages): the first embeds
        `input_ids`, the others continue from the `previous` stage's activations; the
        last returns the final hidden states [T, hidden], the others their
        StageActivations for the next stage."""
        if self.stage.is_first and self.stage.is_last:
            return self.forward(input_ids, positions)
        if self.stage.is_first:
            x, residual = self.embed(input_ids), None
        else:
            assert previous is not None
            x, residual = previous.hidden, previous.residual
        x, residual = self.run_layers(x, residual, positions)
        if self.stage.is_last:
            return self.final_hidden(x, residual)
        assert residual is not None  # every stage holds at least one layer
        return StageActivations(x, residual)

    def run_layers(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's layers over (x, residual), rotating by the frame's table."""
        rope: RopeStep = self.rotary.prepare(positions, x.dtype)
        for layer in self.layer_fns:
            x, residual = layer(x, residual, self.rotary, rope)
        return x, residual

    def final_hidden(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The final norm over the last layer's output and the residual stream."""
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] → fp32 logits [N, vocab]. With tensor parallelism each rank
        computes its vocabulary slice and rank 0 gathers them; the others get None."""
        if not self.with_lm_head:
            raise RuntimeError(f"{type(self).__name__} was built without its LM head, to pool")
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return self.parallel.gather_last_dim(head.logits(hidden_states), self.config.vocab_size)

    def tied_lm_head(self) -> VocabParallelEmbedding | None:
        """The embedding, where it is also the LM head (capabilities.HasTiedLmHead)."""
        tied = self.with_lm_head and self.lm_head is None
        return self.model.embed_tokens if tied else None

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
        load_checkpoint(
            self, with_model_prefix(weights), self.packed_modules_mapping, self.ignored_weight
        )

    def ignored_weight(self, name: str) -> bool:
        """Checkpoint tensors that are not weights of ours."""
        # RoPE's inverse frequencies are derived state in HF's own model; some tied
        # checkpoints store the shared matrix twice; a frame built to pool has no head.
        return (
            name.endswith("rotary_emb.inv_freq")
            or (self.lm_head is None and name == "lm_head.weight")
            or not self._stage_holds_weight(name)
        )

    def _stage_holds_weight(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to a module of this pipeline stage."""
        layer = _LAYER_WEIGHT.match(name)
        if layer is not None:
            return self.stage.holds_layer(int(layer.group(1)))
        if name.startswith("model.embed_tokens."):
            return not isinstance(self.model.embed_tokens, AbsentLayer)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.stage.is_last
        return True
