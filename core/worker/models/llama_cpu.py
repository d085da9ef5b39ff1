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

from plugserve import ops
from plugserve.capabilities import supports_fused_cpu_layer
from plugserve.worker import cpu_linear
from plugserve.worker.kernel_plan import AMX, KernelPlan, bucket_index

_DECODER_SOURCE = ops.DECODER_SOURCE

Matmul = Callable[[torch.Tensor], torch.Tensor]


class FusedCpuDecoderLayer:
    """Called like PreNormDecoderLayer: (x, residual, rotary, rope) → (MLP output, residual).

    Built from a loaded (and, where supported, packed) PreNormDecoderLayer; shares its tensors.
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
        self.fused_mlp_by_bucket = tuple(
            mlp.plan is not None and kernel.fused_mlp
            for kernel in (mlp.plan.by_bucket if mlp.plan is not None else ())
        )
        self.cos_sin = cos_sin
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
        ops = torch.ops.plugserve_ops  # cpu_ops.py's functions, minus a frame each
        if residual is None:
            residual, h = x, ops.rms_norm(x, self.input_norm, self.eps)
        else:
            ops.fused_add_rms_norm(x, residual, self.input_norm, self.eps)  # in place
            h = x

        qkv = self.qkv_proj(h)
        ops.rotary_embedding(qkv, rope.positions, self.cos_sin, self.num_qk_heads, self.head_dim)
        h = self.o_proj(self.attend(qkv))

        ops.fused_add_rms_norm(h, residual, self.post_attention_norm, self.eps)
        if self.fused_mlp is not None and self.fused_mlp_by_bucket[bucket_index(h.shape[0])]:
            return self.fused_mlp(h), residual
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(h))), residual

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """Rotated qkv [T, (q + k + v heads) * D] → attention output [T, q heads * D]."""
        # Split into views; the backend takes any row stride.
        q, k, v = qkv.view(-1, self.num_qkv_heads, self.head_dim).split(self.heads, dim=1)
        return self.attention.forward(self.layer_idx, q, k, v).view(-1, self.q_size)


class FusedCpuDecoder:
    """The whole layer stack of a single-rank model whose linears all run cpu_gemm, called
    as (embeddings, rope) → final-normed hidden states.

    Where the attention backend offers its kernel as a C++ call, the whole stack is one op
    (decode_layers). Otherwise, between two calls of the backend's forward, it makes one op
    call (decode_stretch: o_proj, the norms, the MLP, the next layer's qkv and RoPE), where
    FusedCpuDecoderLayer makes eight and a frame. The final norm is the last stretch's
    "next" norm. Same ops in the same order as FusedCpuDecoderLayer (tested).
    """

    @staticmethod
    def supported(layers: list[FusedCpuDecoderLayer]) -> bool:
        """Whether these layers can run as one: every linear with a cpu_gemm-packed weight
        on one rank (a row-parallel shard's all-reduce needs the module), the op built."""
        linears = [
            linear
            for layer in layers
            for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ]
        return (
            bool(layers)
            and all(isinstance(m, cpu_linear.PackedLinear) and m.own_kernel for m in linears)
            and ops.load(_DECODER_SOURCE)
            and hasattr(torch.ops.plugserve_decoder, "decode_layers")
        )

    def __init__(
        self, layers: list[FusedCpuDecoderLayer], final_norm: torch.Tensor, plan: KernelPlan
    ) -> None:
        self.layers = layers
        first = layers[0]
        # Every stretch's weights, held in C++ once (decode_stretch, decode_layers).
        self.stack = torch.classes.plugserve_decoder.LayerStack(
            first.cos_sin, first.heads[0], first.heads[1], first.head_dim, plan.one_row_mode
        )
        # The steps it runs: those whose row count the plan gives cpu_gemm; the others run
        # layer by layer, each linear through its plan's kernel.
        # (Its matmuls run one cpu_gemm mode: AMX tiles for every row count, or not.)
        stack_amx = plan.one_row_mode == AMX
        self.runs_bucket = tuple(
            kernel.library == "own" and (kernel.one_row_mode == AMX) == stack_amx
            for kernel in plan.by_bucket
        )
        for layer, following in zip(layers, [*layers[1:], None], strict=True):
            o, gate_up, down = map(_packed, (layer.o_proj, layer.gate_up_proj, layer.down_proj))
            qkv = None if following is None else _packed(following.qkv_proj)
            self.stack.add_layer(
                layer.layer_idx,
                o.weight,
                o.own_bias,
                layer.post_attention_norm,
                gate_up.weight,
                gate_up.own_bias,
                down.weight,
                down.own_bias,
                final_norm if following is None else following.input_norm,
                layer.eps,
                None if qkv is None else qkv.weight,
                None if qkv is None else qkv.own_bias,
                0 if qkv is None else qkv.out_features,
                o.coded,
                gate_up.coded,
                down.coded,
                None if qkv is None else qkv.coded,
            )
        self.attention = first.attention
        # Asked once: a Protocol check costs microseconds, too many for every step.
        self.offers_layer_call = supports_fused_cpu_layer(self.attention)

    def runs(self, rows: int) -> bool:
        """Whether a step of `rows` tokens runs here (its kernel is cpu_gemm's)."""
        return self.runs_bucket[bucket_index(rows)]

    def __call__(self, x: torch.Tensor, rope: Any) -> torch.Tensor:
        ops = torch.ops.plugserve_ops
        decoder_ops = torch.ops.plugserve_decoder
        positions = rope.positions
        first = self.layers[0]
        residual = x
        qkv = first.qkv_proj(ops.rms_norm(x, first.input_norm, first.eps))
        ops.rotary_embedding(qkv, positions, first.cos_sin, first.num_qk_heads, first.head_dim)
        # Where the backend offers its kernel as a C++ call (for this step: it may offer it
        # only for some), decode_layers runs every layer in one op.
        call = self.attention.cpu_layer_call() if self.offers_layer_call else None
        if call is not None:
            return decoder_ops.decode_layers(self.stack, qkv, residual, positions, *call)
        for index, layer in enumerate(self.layers):
            qkv = decoder_ops.decode_stretch(
                self.stack, index, layer.attend(qkv), residual, positions
            )
        return qkv  # after the last layer, the final-normed hidden states


def _packed(linear: Matmul) -> cpu_linear.PackedLinear:
    assert isinstance(linear, cpu_linear.PackedLinear)
    return linear
