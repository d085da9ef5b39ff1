"""Gemma 2 and Gemma 3 (text), on the shared layers and frame (models.decoder).

What the families share, as transformers' modeling_gemma2.py / modeling_gemma3.py compute
it: embeddings scaled by sqrt(hidden_size), that factor first rounded to the model dtype;
Gemma's RMSNorm (x / rms(x) * (1 + w), in fp32); four norms per layer, one on each side of
attention and of the MLP (layers.sandwich_decoder_layer); a gated MLP with GELU (tanh
approximation); attention scaled by query_pre_attn_scalar ** -0.5 instead of
1/sqrt(head_dim), with a sliding window on the layers `layer_types` marks
"sliding_attention"; final logits soft-capped where the config says; tied embeddings in
every release. The per-layer attention options go to the backend through
`attention_layers` (interfaces.model.LayerAttention).

Gemma 2 also soft-caps the attention scores (attn_logit_softcapping: 50 in the releases).
Gemma 3 adds a Gemma-style RMSNorm over each q and k head before RoPE, and two RoPE tables:
the sliding layers rotate by the local base (10k), the global layers by the global base
(1M) with its scaling (linear, factor 8, on the 4B-27B models). transformers' Gemma 3
attention never applies attn_logit_softcapping (a config may carry it; the released ones
have null), so neither does this.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from plugserve.interfaces.model import AttentionBackend, LayerAttention
from plugserve.model_files import CheckpointError
from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.mlp import GatedMLP
from plugserve.worker.layers.norm import GemmaRMSNorm
from plugserve.worker.layers.rotary import RotaryEmbedding, rope_parameters
from plugserve.worker.layers.sandwich_decoder_layer import SandwichNormDecoderLayer
from plugserve.worker.models.decoder import DecoderForCausalLM, head_dim_of, num_kv_heads_of
from plugserve.worker.parallel import ParallelContext

SLIDING = "sliding_attention"
FULL = "full_attention"


def layer_types(hf_config: Any) -> list[str]:
    """Each layer's kind, "sliding_attention" or "full_attention" (the config's
    layer_types, which transformers fills from the family's pattern when absent)."""
    kinds = list(hf_config.layer_types)
    unknown = sorted(set(kinds) - {SLIDING, FULL})
    if len(kinds) != hf_config.num_hidden_layers or unknown:
        raise CheckpointError(
            f"layer_types must name {hf_config.num_hidden_layers} layers, each "
            f"{SLIDING!r} or {FULL!r}; got {kinds}"
        )
    return kinds


class Gemma2ForCausalLM(DecoderForCausalLM):
    """interfaces.model.CausalLM for Gemma 2 checkpoints (HF names), tied or untied head."""

    # Gemma 3's q/k norm; Gemma 2 has none.
    qk_norm = False

    def __init__(self, *, hf_config: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise CheckpointError(
                f"{type(self).__name__} with use_bidirectional_attention is not supported "
                "(an embedding model's option; plugserve attends causally)"
            )
        layer_types(hf_config)  # fails early on a malformed pattern
        super().__init__(hf_config=hf_config, **kwargs)
        # transformers keeps the factor as an fp32 tensor and rounds it to the weights'
        # dtype before multiplying: sqrt(3072) = 55.43 becomes 55.5 in bf16.
        self.embed_scale = torch.tensor(hf_config.hidden_size**0.5, dtype=torch.float32)
        self.final_logit_softcap: float | None = hf_config.final_logit_softcapping

    @classmethod
    def attention_softcap(cls, hf_config: Any) -> float | None:
        return hf_config.attn_logit_softcapping

    @classmethod
    def attention_layers(cls, hf_config: Any) -> list[LayerAttention]:
        """Sliding layers see the last `sliding_window` tokens; every layer scales by
        query_pre_attn_scalar ** -0.5 (and Gemma 2 soft-caps its scores)."""
        scale = hf_config.query_pre_attn_scalar**-0.5
        softcap = cls.attention_softcap(hf_config)
        return [
            LayerAttention(
                sliding_window=hf_config.sliding_window if kind == SLIDING else None,
                logit_softcap=softcap,
                scale=scale,
            )
            for kind in layer_types(hf_config)
        ]

    def build_layer(
        self, hf_config: Any, layer_idx: int, attention: AttentionBackend, parallel: ParallelContext
    ) -> SandwichNormDecoderLayer:
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        bias = bool(hf_config.attention_bias)
        return SandwichNormDecoderLayer(
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
                qk_norm_eps=eps if self.qk_norm else None,
                qk_norm=GemmaRMSNorm,
            ),
            GatedMLP(
                hidden,
                hf_config.intermediate_size,
                bias=False,
                hidden_act=hf_config.hidden_activation,
                parallel=parallel,
            ),
            *(GemmaRMSNorm(hidden, eps) for _ in range(4)),
        )

    def build_norm(self, hf_config: Any) -> GemmaRMSNorm:
        return GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * self.embed_scale.to(x.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The frame's logits, soft-capped: cap * tanh(logits / cap)."""
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """interfaces.model.CausalLM for Gemma 3 text checkpoints (Gemma3TextConfig, model_type
    gemma3_text; HF names): Gemma 2's layers with a q/k norm, no attention soft-capping,
    and a RoPE table per layer kind."""

    qk_norm = True

    def __init__(self, *, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config=hf_config, **kwargs)
        # self.rotary (the frame's) is the global layers'; the sliding layers' is this one.
        self.sliding_rotary = self.rotary_for(hf_config, SLIDING)
        self.layer_is_sliding = [kind == SLIDING for kind in layer_types(hf_config)]

    @classmethod
    def attention_softcap(cls, hf_config: Any) -> float | None:
        return None  # transformers' Gemma 3 attention does not apply it (module docstring)

    def build_rotary(self, hf_config: Any) -> RotaryEmbedding:
        return self.rotary_for(hf_config, FULL)

    @staticmethod
    def rotary_for(hf_config: Any, kind: str) -> RotaryEmbedding:
        """The RoPE table of one layer kind: transformers 5 keeps each kind's parameters
        (rope_theta, scaling) under rope_parameters[kind]."""
        theta, scaling = rope_parameters(
            SimpleNamespace(rope_parameters=hf_config.rope_parameters[kind])
        )
        return RotaryEmbedding(
            head_dim_of(hf_config), hf_config.max_position_embeddings, theta, scaling
        )

    def run_layers(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The frame's layer loop over this stage's layers, each layer rotating by its
        kind's table."""
        full = (self.rotary, self.rotary.prepare(positions, x.dtype))
        sliding = (self.sliding_rotary, self.sliding_rotary.prepare(positions, x.dtype))
        kinds = self.layer_is_sliding[self.stage_layers.start : self.stage_layers.stop]
        for layer, is_sliding in zip(self.layer_fns, kinds, strict=True):
            x, residual = layer(x, residual, *(sliding if is_sliding else full))
        return x, residual
