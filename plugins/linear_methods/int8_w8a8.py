"""int8 weights with int8 activations, W8A8 (stack.linear_method: int8), for CPUs with
AVX512-VNNI (and AMX-INT8 tiles where they have them).

Every linear weight [N, K] becomes int8 with one fp32 scale per output row, symmetric and
rounded to nearest (absmax / 127, int8_weight_only.quantize_rows). Each matmul quantizes
its activations per row (token) on the fly, asymmetric to uint8 with a zero point, sums
the int8 products exactly in int32 and dequantizes with the two scales, the zero point
taken out through each weight row's sum (int8_w8a8.cpp). A row's outliers (values more
than six times its root mean square from zero, a few channels of a transformer's
activations) stay out of the codes' range and are multiplied exactly. A batch-1 step reads one byte a
weight, half of bf16's, and the dot products run on VPDPBUSD (or AMX TDPBUSD), not on a
conversion to floats. Which kernel runs each row count is measured (w8a8_plan.py).
Accuracy and speed: docs/benchmarks.md, "int8 (W8A8)".

Since every row's activations are quantized alone and its sums are exact, a row's output
does not depend on the rows batched with it, whichever kernel runs it.

The layers load the checkpoint's weights as the plain method does; after loading, each is
quantized, packed into one huge-page buffer in module order (a step's read order) and the
loaded copy freed; the LM head's too, tied or not (the embedding lookup keeps its rows).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from plugserve import ops
from plugserve.interfaces.model import LinearLayer, TiedLmHead
from plugserve.worker.layers.plain_linear import PlainLinearMethod
from plugserve_plugins.linear_methods import w8a8_plan
from plugserve_plugins.linear_methods.int8_weight_only import quantize_rows
from plugserve_plugins.linear_methods.w8a8_plan import (
    INT_MM,
    KERNEL_IDS,
    REQUIRED_CPU_FLAGS,
    ROW_BUCKETS,
    SOURCE,
    VNNI,
    MeasuredMatmul,
    W8A8Plan,
)

logger = logging.getLogger(__name__)

PAD_K = 64  # the packed K is a multiple of an AMX tile row (64 bytes)


def padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def pack_weight(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int8 [N, K] → [N/16, Kp/4, 16, 4] (N and K padded with zeros to 16 and PAD_K):
    one 64-byte vector is four consecutive k of 16 output columns (int8_w8a8.cpp)."""
    n, k = q.shape
    n_pad, k_pad = padded(n, 16), padded(k, PAD_K)
    full = torch.zeros(n_pad, k_pad, dtype=torch.int8)
    full[:n, :k] = q
    blocked = full.view(n_pad // 16, 16, k_pad // 4, 4).permute(0, 2, 1, 3)
    if out is None:
        return blocked.contiguous()
    out.copy_(blocked)
    return out


def packed_bytes(out_features: int, in_features: int) -> int:
    return padded(out_features, 16) * padded(in_features, PAD_K)


class W8A8Linear:
    """A quantized weight, installed as the layer's matmul (interfaces.model.LinearCompute):
    (x [M, K], out_dtype) → x @ w.T + bias [M, N], in out_dtype (default x's dtype), each
    row count by its plan's kernel (VNNI until use_plan). `packed` is where the packed
    weight goes (a slice of the model's buffer), else its own. Offers its matmul as a C++
    call (capabilities.SupportsCpuLinearCall)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        packed: torch.Tensor | None = None,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        q, self.scale = quantize_rows(weight)
        self.weight_sum = q.sum(dim=1, dtype=torch.int32)
        self.packed = pack_weight(q, packed)
        # The plain quantized weight, which torch._int_mm reads: kept until a plan that
        # does not run it.
        self.plain: torch.Tensor | None = q if w8a8_plan.int_mm_available() else None
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._apply = torch.ops.plugserve_w8a8.w8a8_apply
        self.use_plan(W8A8Plan(tuple(VNNI for _ in ROW_BUCKETS)), keep_plain=True)

    def use_plan(self, plan: W8A8Plan, keep_plain: bool = False) -> None:
        """Run each row count by `plan`'s kernel; the plain weight is dropped where no
        bucket reads it (unless `keep_plain`)."""
        self.plan = plan
        if not (keep_plain or plan.uses(INT_MM)):
            self.plain = None
        self.weight = torch.classes.plugserve_w8a8.W8A8Weight(
            self.packed,
            self.plain,
            self.scale,
            self.weight_sum,
            self.bias,
            self.out_features,
            [KERNEL_IDS[kernel] for kernel in plan.by_bucket],
            [bucket.last for bucket in ROW_BUCKETS[:-1]],
        )

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self._apply(self.weight, rows, out_dtype or x.dtype, -1)
        return out.view(*x.shape[:-1], self.out_features)

    def run(
        self, kernel: str, x: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x [M, K] through `kernel` (w8a8_plan's names), whatever the plan says."""
        return self._apply(self.weight, x, out_dtype or x.dtype, KERNEL_IDS[kernel])

    def cpu_linear_call(self) -> tuple[int, int]:
        """capabilities.SupportsCpuLinearCall: layer_linear.h's call over this weight,
        valid until use_plan builds another."""
        return torch.ops.plugserve_w8a8.linear_call_address(), self.weight.address()

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel computes with, fp32 [N, K] (for tests and references)."""
        padded_k = self.packed.shape[1] * 4
        blocked = self.packed.permute(0, 2, 1, 3).reshape(-1, padded_k)
        return blocked[: self.out_features, : self.in_features].float() * self.scale[:, None]

    def measured(self) -> MeasuredMatmul:
        return MeasuredMatmul(
            lambda kernel, x: self.run(kernel, x), self.in_features, self.out_features
        )


class Int8W8A8(PlainLinearMethod):
    """interfaces.model.LinearMethod: int8 weights with per-row fp32 scales, activations
    quantized per token to int8 (capabilities: DescribesLinears)."""

    def __init__(self) -> None:
        self.plan: W8A8Plan | None = None
        self.buffer: torch.Tensor | None = None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the kernel cannot run on this CPU (missing AVX512-VNNI, a failed build), or
        None."""
        flags = set(ops.cpu_flags().split())
        missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]
        if missing:
            return f"the W8A8 int8 kernel needs a CPU with {', '.join(missing)}"
        reason = ops.unavailable_reason(ops.OPS_SOURCE)  # the row pool's owner
        reason = reason or ops.unavailable_reason(SOURCE)
        if reason is None and not hasattr(torch.ops.plugserve_w8a8, "w8a8_apply"):
            return "int8_w8a8.cpp was built without its kernel (-march=native lacks AVX512-VNNI)"
        return reason

    def create_weights(self, layer: LinearLayer) -> None:
        super().create_weights(layer)
        device = layer.weight.device  # type: ignore[attr-defined]
        if device.type != "cpu":  # refused before anything loads
            raise ValueError(f"int8 (W8A8) quantization runs on CPU, not {device}")

    def process_weights_after_loading(
        self,
        layers: Sequence[LinearLayer],
        *,
        model: nn.Module,
        tied_head: TiedLmHead | None,
    ) -> None:
        weights = [layer.weight for layer in layers]  # type: ignore[attr-defined]
        if tied_head is not None:
            weights.append(tied_head.weight)
        if not weights:
            return
        reason = self.unavailable_reason()
        if reason:
            raise ValueError(f"int8 (W8A8) quantization cannot run here: {reason}")
        # Every packed weight in one huge-page buffer, in module order: a batch-1 step
        # streams them front to back.
        sizes = [packed_bytes(*w.shape) for w in weights]
        self.buffer = ops.huge_page_buffer(sum(sizes)).view(torch.int8)
        slices = self.buffer.split(sizes)
        linears = []
        for layer, place in zip(layers, slices, strict=False):
            linear = self.quantize(layer.weight, layer.matmul_bias, place)  # type: ignore[attr-defined]
            layer.install(linear)
            linears.append(linear)
        if tied_head is not None:
            head = self.quantize(tied_head.weight, packed=slices[-1])
            tied_head.install_head(head)
            linears.append(head)
        self.plan = w8a8_plan.plan_for([linear.measured() for linear in linears])
        for linear in linears:
            linear.use_plan(self.plan)
        if self.plan.times_ms:
            logger.info(
                "W8A8 int8 kernels by rows, ms for the leading matmuls, * chosen (%s):\n%s",
                "measured before, cached" if self.plan.from_cache else "measured now",
                self.plan.table(),
            )

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
    ) -> W8A8Linear:
        """One weight [N, K] (and bias [N]) as loaded → its W8A8 matmul, packed into
        `packed` (an int8 tensor of packed_bytes) where given."""
        if weight.device.type != "cpu":
            raise ValueError(f"int8 (W8A8) quantization runs on CPU, not {weight.device}")
        reason = self.unavailable_reason()
        if reason:
            raise ValueError(f"int8 (W8A8) quantization cannot run here: {reason}")
        if packed is not None:
            n, k = weight.shape
            packed = packed.view(padded(n, 16) // 16, padded(k, PAD_K) // 4, 16, 4)
        return W8A8Linear(weight.detach(), bias, packed=packed)

    def describe(self) -> str:
        plan = "" if self.plan is None else f" ({self.plan.describe()})"
        return f"linears: int8 weights and per-token int8 activations (W8A8){plan}"
