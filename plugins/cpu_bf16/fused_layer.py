"""A pre-norm decoder layer for bfloat16 on CPU: its math as one function over plain
tensors, called where the modules' forward would be (the fused_cpu_decoder pass puts it in
the model's `layer_fns`, fused_decoder.py).

The module path spends a share of a batch-1 decode step in Python (three frames per
linear layer, nn.Module attribute lookups, the norm, RoPE and activation wrappers, every
layer over). This layer runs the same ops in the same order from one frame: fused norms
with the residual add, the packed matmuls, Qwen3's q/k norm over each head, RoPE in
place (or none, in a NoPE layer; over the first rotary dimensions of each head with a
partial rotary factor), the attention backend, SiLU * up, or, for the prefill chunks the
kernel plan gives it, the MLP as oneDNN post-ops (fused_mlp.py). The small ops are core's
cpu_ops.cpp; each linear runs through its cheapest callable (`Linear.kernel`): what its
method installed, or, where there is none or a row-parallel shard still needs its
all-reduce, the module. The two paths compute the same values up to bf16 rounding
(tests/unit/cpu_bf16/test_fused_decoder.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plugserve.ops.kernel_timing import bucket_index
from plugserve.worker.layers.decoder_layer import PreNormDecoderLayer
from plugserve_plugins.cpu_bf16.fused_mlp import FusedMLP
from plugserve_plugins.cpu_bf16.kernel_plan import KernelPlan

Matmul = Callable[[torch.Tensor], torch.Tensor]


class FusedCpuDecoderLayer:
    """Called like PreNormDecoderLayer: (x, residual, rotary, rope) → (MLP output, residual).

    Built from a loaded (and, where supported, packed) PreNormDecoderLayer with a plain
    RMSNorm on each side of attention and a SiLU GatedMLP; shares its tensors. `cos_sin`:
    the rotary table it rotates by (RotaryEmbedding.cos_sin), None for a layer that does
    not rotate. `fused_mlp`: the MLP as oneDNN post-ops, run for the buckets whose kernel
    in `plan` says so."""

    def __init__(
        self,
        layer: PreNormDecoderLayer,
        cos_sin: torch.Tensor | None,
        fused_mlp: FusedMLP | None = None,
        plan: KernelPlan | None = None,
    ) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm.weight
        self.post_attention_norm = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.qkv_proj: Matmul = attn.qkv_proj.kernel()
        self.o_proj: Matmul = attn.o_proj.kernel()
        self.gate_up_proj: Matmul = mlp.gate_up_proj.kernel()
        self.down_proj: Matmul = mlp.down_proj.kernel()
        self.fused_mlp = fused_mlp
        self.fused_mlp_by_bucket = tuple(
            fused_mlp is not None and kernel.fused_mlp
            for kernel in (plan.by_bucket if plan is not None else ())
        )
        if attn.rotate and cos_sin is None:
            raise ValueError(f"layer {attn.layer_idx} rotates q and k: it needs the table")
        self.cos_sin = cos_sin if attn.rotate else None
        # Qwen3's RMSNorm over each q and each k head, before RoPE (None: no q/k norm).
        self.q_norm = None if attn.q_norm is None else attn.q_norm.weight
        self.k_norm = None if attn.k_norm is None else attn.k_norm.weight
        self.qk_norm_eps = 0.0 if attn.q_norm is None else attn.q_norm.eps
        self.attention = attn.attention
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.heads = (attn.num_heads, attn.num_kv_heads, attn.num_kv_heads)  # q, k, v
        self.num_qkv_heads = sum(self.heads)
        self.num_qk_heads = attn.num_heads + attn.num_kv_heads
        self.q_size = attn.q_size

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Any, rope: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = torch.ops.plugserve_ops  # cpu_ops.cpp's ops, minus a Python frame each
        if residual is None:
            residual, h = x, ops.rms_norm(x, self.input_norm, self.eps)
        else:
            ops.fused_add_rms_norm(x, residual, self.input_norm, self.eps)  # in place
            h = x

        qkv = self.qkv_proj(h)
        self.norm_and_rotate(qkv, rope.positions)
        h = self.o_proj(self.attend(qkv))

        ops.fused_add_rms_norm(h, residual, self.post_attention_norm, self.eps)
        if self.fused_mlp is not None and self.fused_mlp_by_bucket[bucket_index(h.shape[0])]:
            return self.fused_mlp(h), residual
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(h))), residual

    def norm_and_rotate(self, qkv: torch.Tensor, positions: torch.Tensor) -> None:
        """In place on the projected qkv [T, (q + k + v heads) * D]: the q/k norm over each
        q and k head where the layer has one, then RoPE over q and k where it rotates."""
        ops = torch.ops.plugserve_ops
        q_heads, kv_heads = self.heads[0], self.heads[1]
        if self.q_norm is not None and self.k_norm is not None:
            ops.rms_norm_heads(qkv, self.q_norm, self.qk_norm_eps, 0, q_heads, self.head_dim)
            ops.rms_norm_heads(qkv, self.k_norm, self.qk_norm_eps, q_heads, kv_heads, self.head_dim)
        if self.cos_sin is not None:
            ops.rotary_embedding(qkv, positions, self.cos_sin, self.num_qk_heads, self.head_dim)

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """Rotated qkv [T, (q + k + v heads) * D] → attention output [T, q heads * D]."""
        # Split into views; the backend takes any row stride.
        q, k, v = qkv.view(-1, self.num_qkv_heads, self.head_dim).split(self.heads, dim=1)
        return self.attention.forward(self.layer_idx, q, k, v).view(-1, self.q_size)
