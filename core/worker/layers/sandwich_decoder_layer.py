"""The decoder layer with a norm on each side of each sublayer (Gemma 2 and 3):
x + post_attn_norm(attn(input_norm(x))), then + post_ff_norm(mlp(pre_ff_norm(x))).

Unlike the pre-norm layer (decoder_layer.py), each sublayer's output is normalized before
it joins the residual stream. The stream is carried apart as there: a layer takes the
previous layer's last output and the stream before it, and the add happens inside the
next norm (`add_and_norm`); the first layer gets the embeddings and no residual.
"""

from __future__ import annotations

import torch
from torch import nn

from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.direct_call import direct_call
from plugserve.worker.layers.rotary import RopeStep, RotaryEmbedding


@direct_call
class SandwichNormDecoderLayer(nn.Module):
    """Gemma's layer, with transformers' module names. The norms are any with
    `add_and_norm` (norm.GemmaRMSNorm for Gemma)."""

    def __init__(
        self,
        self_attn: Attention,
        mlp: nn.Module,
        input_layernorm: nn.Module,
        post_attention_layernorm: nn.Module,
        pre_feedforward_layernorm: nn.Module,
        post_feedforward_layernorm: nn.Module,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.pre_feedforward_layernorm = pre_feedforward_layernorm
        self.post_feedforward_layernorm = post_feedforward_layernorm

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        rope: RopeStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (this layer's normed MLP output, the residual stream before it)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rotary, rope))
        h, residual = self.pre_feedforward_layernorm.add_and_norm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual
