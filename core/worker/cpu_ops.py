"""Fused small ops for a CPU transformer layer (cpu_ops.cpp): a decoder's RMSNorm with the
residual add or over each q and k head, RoPE in place, SiLU(gate) * up; an encoder's GELU
in place and LayerNorm over the residual add; and the sampler's greedy argmax.

Used for bfloat16 on CPU, where the unfused ATen versions cost more in per-op dispatch
and fp32 round trips than in arithmetic. float32 keeps ATen's ops, which match Hugging
Face bit for bit; these compute in fp32 and round once, so in bf16 they are as close to
the fp32 reference as the unfused ops or closer.
"""

from __future__ import annotations

import torch

from plugserve import ops

_SOURCE = ops.OPS_SOURCE


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the fused ops run for activations of this dtype on this device (built on
    first call)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and ops.load(_SOURCE)


def supported_for(x: torch.Tensor) -> bool:
    """supported() for x's dtype and device."""
    return supported(x.dtype, x.device)


def load() -> bool:
    return ops.load(_SOURCE)


def unavailable_reason() -> str | None:
    """None where the fused ops are built and loaded (load()), else why they are not."""
    return ops.unavailable_reason(_SOURCE)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] → x / rms(x) * weight, a new tensor."""
    return torch.ops.plugserve_ops.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, then x = rms_norm(residual) * weight. Returns (x, residual)."""
    torch.ops.plugserve_ops.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rms_norm_heads(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    first_head: int,
    num_heads: int,
    head_dim: int,
) -> None:
    """In place: heads [first_head, first_head + num_heads) of each row of x [T, >= heads *
    D] (row stride free, last dim dense), each x / rms(x) * weight over its D values."""
    torch.ops.plugserve_ops.rms_norm_heads(x, weight, eps, first_head, num_heads, head_dim)


def rotary_embedding(
    qk: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, head_dim: int
) -> None:
    """Rotates, in place, the first num_heads heads of each row of qk [T, >= heads * D]
    (row stride free, last dim dense) by its position. cos_sin: fp32 [positions, R], the
    cosines of the R/2 frequencies then their sines: each head's first R dimensions rotate
    (R = D, or a partial rotary factor's part), the rest pass through."""
    torch.ops.plugserve_ops.rotary_embedding(qk, positions, cos_sin, num_heads, head_dim)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate columns, then up) → silu(gate) * up, a new [T, I] tensor."""
    return torch.ops.plugserve_ops.silu_and_mul(gate_up)


def gelu_(x: torch.Tensor, tanh_form: bool) -> torch.Tensor:
    """In place: x [T, N] (row stride free, last dim dense) = GELU(x), the erf form or the
    tanh approximation. Returns x."""
    torch.ops.plugserve_ops.gelu_(x, tanh_form)
    return x


def add_layer_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """In place: x [T, hidden] = LayerNorm(x + residual) * weight + bias, the sum in fp32
    (not rounded before the norm, as an unfused add would). Returns x."""
    torch.ops.plugserve_ops.add_layer_norm_(x, residual, weight, bias, eps)
    return x


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) for [rows, vocab] logits (first index on ties, as torch);
    through cpu_ops on CPU float32 (faster than ATen's: cpu_ops.cpp), else ATen."""
    native = (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and ops.load(_SOURCE)
    )
    return torch.ops.plugserve_ops.argmax_rows(logits) if native else logits.argmax(dim=-1)
