"""The layers of a BERT-style encoder: learned absolute position and token-type
embeddings, and the post-LayerNorm transformer layer (attention, add, LayerNorm; dense,
GELU, dense, add, LayerNorm) whose attention is bidirectional.

In bf16 on a CPU the GELU and the add + LayerNorm run as cpu_ops' in-place ops (one pass
each, in fp32, rounded once); elsewhere as ATen's.

Module names follow transformers' BERT (`attention.self`, `attention.output.dense`,
`intermediate.dense`, `output.LayerNorm`, ...), so a checkpoint loads by name; q, k and v
load into one fused projection (ENCODER_QKV).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.interfaces.model import AttentionBackend
from plugserve.worker import cpu_ops
from plugserve.worker.layers.checkpoint import PackedModulesMapping
from plugserve.worker.layers.direct_call import direct_call
from plugserve.worker.layers.embedding import VocabParallelEmbedding
from plugserve.worker.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext

# transformers' BERT names q, k and v `query`, `key`, `value`.
ENCODER_QKV: PackedModulesMapping = {
    "query": ("qkv_proj", "q"),
    "key": ("qkv_proj", "k"),
    "value": ("qkv_proj", "v"),
}

ENCODER_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# The GELUs cpu_ops runs in place on bf16 (by table): whether each is the tanh form.
_CPU_OPS_GELU_TANH = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


class EncoderEmbeddings(nn.Module):
    """word + absolute position + token type embeddings, then LayerNorm. A position id is
    the token's position in its prompt plus `position_offset` (XLM-R counts from
    padding_idx + 1)."""

    def __init__(
        self, hf_config: Any, position_offset: int = 0, parallel: ParallelContext = NO_PARALLEL
    ) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(hf_config.vocab_size, hidden, parallel)
        self.position_embeddings = nn.Embedding(hf_config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(max(hf_config.type_vocab_size, 1), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=hf_config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.position_offset
        )
        if token_type_ids is None:  # every token of segment 0
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


@direct_call
class EncoderSelfAttention(nn.Module):
    """x [T, hidden] → this rank's heads' attention output [T, heads * head_dim], through
    the backend (which attends bidirectionally: the model says so per layer)."""

    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        attention: AttentionBackend,
        parallel: ParallelContext = NO_PARALLEL,
    ) -> None:
        super().__init__()
        num_heads = hf_config.num_attention_heads
        self.head_dim = hf_config.hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size, self.head_dim, num_heads, num_heads, True, parallel
        )
        self.num_heads = self.qkv_proj.heads.num_heads
        self.q_size = self.qkv_proj.q_size
        self.layer_idx = layer_idx
        self.attention = attention  # not a submodule: one backend serves every layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size] * 3, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)
        out = self.attention.forward(self.layer_idx, q.view(shape), k.view(shape), v.view(shape))
        return out.reshape(-1, self.q_size)


class DenseAddNorm(nn.Module):
    """LayerNorm(dense(x) + residual): row-parallel over this rank's slice of x."""

    def __init__(
        self,
        in_features: int,
        hf_config: Any,
        parallel: ParallelContext = NO_PARALLEL,
        input_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.dense = RowParallelLinear(
            in_features, hf_config.hidden_size, True, parallel, input_range=input_range
        )
        self.LayerNorm = nn.LayerNorm(hf_config.hidden_size, eps=hf_config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = self.dense(x)
        if cpu_ops.supported_for(out):  # one pass, the sum unrounded
            norm = self.LayerNorm
            return cpu_ops.add_layer_norm_(out, residual, norm.weight, norm.bias, norm.eps)
        return self.LayerNorm(out + residual)


class EncoderAttentionBlock(nn.Module):
    def __init__(
        self, hf_config: Any, layer_idx: int, attention: AttentionBackend, parallel: ParallelContext
    ) -> None:
        super().__init__()
        # transformers' name; only an attribute here.
        self.self = EncoderSelfAttention(hf_config, layer_idx, attention, parallel)
        heads, head_dim = self.self.qkv_proj.heads, self.self.head_dim
        self.output = DenseAddNorm(
            hf_config.hidden_size,
            hf_config,
            parallel,
            input_range=(heads.q_start * head_dim, heads.q_end * head_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class Intermediate(nn.Module):
    def __init__(self, hf_config: Any, parallel: ParallelContext) -> None:
        super().__init__()
        act = hf_config.hidden_act
        if act not in ENCODER_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {act!r} (supported: {', '.join(ENCODER_ACTIVATIONS)})"
            )
        self.dense = ColumnParallelLinear(
            hf_config.hidden_size, hf_config.intermediate_size, True, parallel
        )
        self.act = ENCODER_ACTIVATIONS[act]
        self.cpu_ops_tanh = _CPU_OPS_GELU_TANH.get(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        if self.cpu_ops_tanh is not None and cpu_ops.supported_for(h):
            return cpu_ops.gelu_(h, self.cpu_ops_tanh)
        return self.act(h)


class EncoderLayer(nn.Module):
    """Post-LayerNorm: x → LN(x + attn(x)) → LN(h + down(act(up(h))))."""

    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        attention: AttentionBackend,
        parallel: ParallelContext = NO_PARALLEL,
    ) -> None:
        super().__init__()
        self.attention = EncoderAttentionBlock(hf_config, layer_idx, attention, parallel)
        self.intermediate = Intermediate(hf_config, parallel)
        self.output = DenseAddNorm(hf_config.intermediate_size, hf_config, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention(x)
        return self.output(self.intermediate(h), h)
