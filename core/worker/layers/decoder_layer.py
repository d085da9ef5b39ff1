"""The pre-norm decoder layer most families use: x + attn(norm(x)), then + mlp(norm(x)).

The residual stream is carried apart from the sublayer outputs, so each add happens
inside the next norm (`add_and_norm`: one pass over the activations, in the fused op);
the first layer gets the embeddings as x and no residual.
"""

from __future__ import annotations

import torch
from torch import nn

from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.direct_call import direct_call
from plugserve.worker.layers.norm import RMSNorm
from plugserve.worker.layers.rotary import RopeStep, RotaryEmbedding


@direct_call
class PreNormDecoderLayer(nn.Module):
    """Llama's layer (and Qwen2's, Qwen3's, Mistral's, ...): HF's module names."""

    def __init__(
        self,
        self_attn: Attention,
        mlp: nn.Module,
        input_layernorm: RMSNorm,
        post_attention_layernorm: RMSNorm,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        rope: RopeStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (this layer's MLP output, the residual stream before it)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, rotary, rope)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual
