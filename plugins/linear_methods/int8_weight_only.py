"""int8 weight-only quantization for AVX-512 CPUs (stack.linear_method: int8_weight_only).

Every linear weight [N, K] becomes int8 with one fp32 scale per output row, symmetric and
rounded to nearest: scale = absmax(row) / 127, q = round(w / scale). Activations stay
bf16; the kernel (int8_weight_only.cpp) dequantizes in registers for up to 8 rows, so a
batch-1 step reads one byte a weight instead of bf16's two, and dequantizes blocks of
weights to bf16 for oneDNN's matmul beyond that. Measured accuracy and speed:
docs/benchmarks.md, "int8 weight-only".

The layers load the checkpoint's weights as the plain method does; after loading, each
weight is quantized and the loaded copy freed, the LM head's too, tied or not (the
embedding lookup keeps its rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from plugserve import ops
from plugserve.interfaces.model import LinearLayer, TiedLmHead
from plugserve.worker.layers.plain_linear import PlainLinearMethod

_SOURCE = Path(__file__).with_suffix(".cpp")
# The kernel's instructions (-march=native builds them; a CPU without them cannot run it).
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (int8 [N, K], fp32 scale [N]): w ≈ q * scale per row, absmax/127,
    round to nearest (an all-zero row gets scale 1 and zeros)."""
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear:
    """A quantized weight, installed as the layer's matmul (interfaces.model.LinearCompute):
    (x [M, K], out_dtype) → x @ w.T + bias [M, N], in out_dtype (default x's dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.q, self.scale = quantize_rows(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = weight.shape
        self._op = torch.ops.plugserve_int8.int8_linear

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self._op(rows, self.q, self.scale, self.bias, out_dtype or x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel computes with, fp32 [N, K] (for tests and references)."""
        return self.q.float() * self.scale[:, None]


class Int8WeightOnly(PlainLinearMethod):
    """interfaces.model.LinearMethod: int8 weights, per-row fp32 scales, bf16 activations."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the kernel cannot run on this CPU (missing AVX-512, a failed build), or None."""
        flags = set(ops.cpu_flags().split())
        missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]
        if missing:
            return f"the int8 kernel needs a CPU with {', '.join(missing)}"
        return ops.unavailable_reason(_SOURCE)

    def create_weights(self, layer: LinearLayer) -> None:
        super().create_weights(layer)
        device = layer.weight.device  # type: ignore[attr-defined]
        if device.type != "cpu":  # refused before anything loads
            raise ValueError(f"int8 weight-only quantization runs on CPU, not {device}")

    def process_weights_after_loading(
        self,
        layers: Sequence[LinearLayer],
        *,
        model: nn.Module,
        tied_head: TiedLmHead | None,
    ) -> None:
        for layer in layers:
            layer.install(self.quantize(layer.weight, layer.matmul_bias))  # type: ignore[attr-defined]
        if tied_head is not None:
            tied_head.install_head(self.quantize(tied_head.weight))

    def quantize(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """One weight [N, K] (and bias [N]) as loaded → its int8 matmul."""
        if weight.device.type != "cpu":
            raise ValueError(f"int8 weight-only quantization runs on CPU, not {weight.device}")
        reason = self.unavailable_reason()
        if reason:
            raise ValueError(f"int8 weight-only quantization cannot run here: {reason}")
        return Int8Linear(weight.detach(), bias)

    def describe(self) -> str:
        return "linears: int8 weight-only quantized"
