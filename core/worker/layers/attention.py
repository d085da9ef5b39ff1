"""Self-attention over the paged KV cache, around the AttentionBackend.

One fused QKV projection (column-parallel by heads), optionally an RMSNorm over each q
and each k head (Qwen3's q/k norm; Gemma 3's in Gemma's form), before RoPE; q and k
rotated together (or, in a layer without position embeddings, SmolLM3's "NoPE" layers,
passed as projected), the backend's paged attention over this rank's heads, the output
projection (row-parallel over the same heads' columns, summed over ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plugserve.interfaces.model import AttentionBackend
from plugserve.worker.layers.direct_call import direct_call
from plugserve.worker.layers.linear import QKVParallelLinear, RowParallelLinear
from plugserve.worker.layers.norm import RMSNorm
from plugserve.worker.layers.rotary import RopeStep, RotaryEmbedding
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext


@direct_call
class Attention(nn.Module):
    """x [T, hidden] → [T, hidden]. Under tensor parallelism each rank attends over its
    own heads, and o_proj's all-reduce sums the ranks' parts."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        attention: AttentionBackend,
        qkv_bias: bool,
        o_bias: bool,
        parallel: ParallelContext = NO_PARALLEL,
        qk_norm_eps: float | None = None,
        qk_norm: Callable[[int, float], nn.Module] = RMSNorm,
        rotate: bool = True,
    ):
        """num_heads, num_kv_heads: the model's (all ranks'); this rank keeps its shard.
        qk_norm_eps: give each q and k head an RMSNorm over head_dim (weights shared by
        the heads, so every rank holds them whole) with this epsilon; `qk_norm` builds it
        from (head_dim, eps) (norm.GemmaRMSNorm for Gemma 3).
        rotate: False for a layer without rotary position embeddings (q and k attend as
        projected; SmolLM3's NoPE layers).
        How the backend attends this layer (scale, window, soft-cap) is the backend's, by
        layer_idx (interfaces.model.AttentionSpec.layers)."""
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias, parallel
        )
        self.shard = self.qkv_proj.heads  # this rank's heads (all without parallelism)
        self.num_heads = self.shard.num_heads
        self.num_kv_heads = self.shard.num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.num_qk_heads = self.num_heads + self.num_kv_heads
        self.o_proj = RowParallelLinear(
            num_heads * head_dim,
            hidden_size,
            o_bias,
            parallel,
            input_range=(self.shard.q_start * head_dim, self.shard.q_end * head_dim),
        )
        self.q_norm = None if qk_norm_eps is None else qk_norm(head_dim, qk_norm_eps)
        self.k_norm = None if qk_norm_eps is None else qk_norm(head_dim, qk_norm_eps)
        self.rotate = rotate
        self.layer_idx = layer_idx
        self.attention = attention  # not a submodule: one backend serves every layer

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, rope: RopeStep) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            qkv = self._norm_qk_heads(qkv)
        # q and k rotate as one [T, heads + kv_heads, D] block of the fused output.
        if self.rotate:
            qk = rotary(qkv, rope, self.num_qk_heads)
        else:
            qk = qkv[:, : self.num_qk_heads * self.head_dim].view(
                -1, self.num_qk_heads, self.head_dim
            )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.attention.forward(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _norm_qk_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each q and k head RMS-normalized, v as it was (a new tensor: the norm
        is not in place)."""
        assert self.q_norm is not None and self.k_norm is not None
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).flatten(1)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).flatten(1)
        return torch.cat((q, k, v), dim=-1)
