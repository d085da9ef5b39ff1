"""Linear layers through oneDNN with weights packed once at load (CPU, bfloat16).

`F.linear` on CPU re-lays out a bf16 weight for oneDNN on every call; packing it once
into oneDNN's blocked layout makes a decode step's matmuls 1.3x (32 rows) to 2.3x (one
row) faster on an AVX-512-BF16 CPU, with bit-identical results. In float32 the packed
kernel is faster still but rounds differently from `F.linear` (~1e-5), which would break
the bit-for-bit match with Hugging Face the float32 path keeps, so only bf16 is packed.

For prefill-sized inputs the MLP runs as oneDNN post-ops (FusedMLP): SiLU and the
gate * up product are applied to the fp32 accumulators inside the matmuls rather than as
separate bf16 passes over [tokens, intermediate] tensors, which took a third of a
2048-token prefill's MLP time. Results differ from the unfused path by bf16
rounding (the post-ops see unrounded values). For a few rows the extra matmul call costs
more than the passes it saves, hence the threshold.
"""

from __future__ import annotations

import torch


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight → an opaque oneDNN-packed tensor for `linear`."""
    # Any batch-size hint picks a layout that runs prefill-sized inputs (128 rows) ~20%
    # faster than the hint-less default, and decode sizes no slower (measured, torch 2.13).
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


class PackedLinear:
    """x @ weight.T + bias through oneDNN, the weight packed once."""

    __slots__ = ("bias", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = pack_weight(weight)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


# Below this many tokens the MLP keeps one fused gate-up matmul and separate passes.
FUSED_MLP_MIN_TOKENS = 128


class FusedMLP:
    """down(silu(gate(x)) * up(x)) in three packed matmuls, SiLU and * up as post-ops."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate = pack_weight(gate.contiguous())
        self.up = pack_weight(up.contiguous())
        self.down = pack_weight(down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.mkldnn
        activated = ops._linear_pointwise(x, self.gate, None, "swish", [], "")
        hidden = ops._linear_pointwise.binary(x, activated, self.up, None, "mul")
        return ops._linear_pointwise(hidden, self.down, None, "none", [], "")
