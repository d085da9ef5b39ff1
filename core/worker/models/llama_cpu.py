"""The Llama decoder layer for bfloat16 on CPU: its math as one function over plain tensors.

A batch-1 decode step of SmolLM2-135M is ~8 ms on two cores, and the module path spent
0.5-0.7 ms of it in Python: three frames per linear layer, nn.Module attribute lookups,
the norm, RoPE and activation wrappers, thirty layers over. This layer runs the same ops
in the same order (fused norms with the residual add, packed matmuls, RoPE in place, the
attention backend, SiLU * up) from one frame per layer.

LlamaForCausalLM switches to it after loading wherever the fused CPU ops (cpu_ops) are on.
Each linear runs through its cheapest callable (`Linear.kernel`): the packed weight
(cpu_linear), or, where there is none or a row-parallel shard still needs its all-reduce,
the module. Everywhere else (fp32, CUDA) the modules' own forwards run; the two paths
compute the same values (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plugserve.worker import cpu_linear

Matmul = Callable[[torch.Tensor], torch.Tensor]


class FusedCpuDecoderLayer:
    """Called like LlamaDecoderLayer: (x, residual, rotary, rope) → (MLP output, residual).

    Built from a loaded (and, where supported, packed) LlamaDecoderLayer; shares its tensors.
    """

    def __init__(self, layer: Any, cos_sin: torch.Tensor) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm.weight
        self.post_attention_norm = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.qkv_proj: Matmul = attn.qkv_proj.kernel()
        self.o_proj: Matmul = attn.o_proj.kernel()
        self.gate_up_proj: Matmul = mlp.gate_up_proj.kernel()
        self.down_proj: Matmul = mlp.down_proj.kernel()
        self.fused_mlp: cpu_linear.FusedMLP | None = mlp.fused
        self.cos_sin = cos_sin
        self.attention = attn.attention
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.heads = (attn.num_heads, attn.num_kv_heads, attn.num_kv_heads)  # q, k, v
        self.num_qk_heads = attn.num_heads + attn.num_kv_heads
        self.q_size = attn.q_size

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Any, rope: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = torch.ops.plugserve_ops  # cpu_ops.py's functions, minus a frame each
        if residual is None:
            residual, h = x, ops.rms_norm(x, self.input_norm, self.eps)
        else:
            ops.fused_add_rms_norm(x, residual, self.input_norm, self.eps)  # in place
            h = x

        qkv = self.qkv_proj(h)
        ops.rotary_embedding(qkv, rope.positions, self.cos_sin, self.num_qk_heads, self.head_dim)
        # [T, q + k + v heads, D] split into views; the backend takes any row stride.
        q, k, v = qkv.view(-1, sum(self.heads), self.head_dim).split(self.heads, dim=1)
        out = self.attention.forward(self.layer_idx, q, k, v)
        h = self.o_proj(out.view(-1, self.q_size))

        ops.fused_add_rms_norm(h, residual, self.post_attention_norm, self.eps)
        if self.fused_mlp is not None and h.shape[0] >= cpu_linear.FUSED_MLP_MIN_TOKENS:
            return self.fused_mlp(h), residual
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(h))), residual
