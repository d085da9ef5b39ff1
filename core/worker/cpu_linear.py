"""Linear layers for bfloat16 on CPU, with weights packed once at load.

Two kernels, picked once per machine:

- cpu_gemm.cpp, on CPUs with AVX512_BF16 and no AMX: VDPBF16PS over a k-pair-interleaved
  copy of the weight (`pack_k_pairs`). It streams the weights at the memory bandwidth at
  decode sizes, where oneDNN does not (SmolLM2's matmuls on a 2-core Zen 5: 24 % faster
  at 1 row, 16 % at 32, equal at 512 to 2048 rows). Sums run in another order than
  `F.linear`'s, so results differ from it by fp32 rounding before the bf16 store.
- oneDNN elsewhere (and on AMX CPUs, whose tile kernels this one was never measured
  against): the weight is reordered once into oneDNN's blocked layout, since `F.linear`
  re-lays out a bf16 weight on every call; bit-identical to `F.linear`. For
  prefill-sized inputs the MLP then runs as oneDNN post-ops (FusedMLP): SiLU and
  gate * up applied to the fp32 accumulators inside the matmuls instead of separate bf16
  passes over [tokens, intermediate] tensors, a third of a 2048-token prefill's MLP.

float32 is never packed: the fp32 path keeps `F.linear`, bit for bit with Hugging Face.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from plugserve.worker import cpp_extension

_GEMM_SOURCE = Path(__file__).with_name("cpu_gemm.cpp")


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and (uses_own_kernel() or _onednn_bf16_supported())
    )


def _onednn_bf16_supported() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@cache
def uses_own_kernel() -> bool:
    """Whether bf16 linears run cpu_gemm.cpp here (built on first call) rather than oneDNN."""
    flags = cpp_extension.cpu_flags().split()
    if "avx512_bf16" not in flags or "amx_bf16" in flags:
        return False
    return cpp_extension.load(_GEMM_SOURCE) and hasattr(torch.ops.plugserve_gemm, "linear_bf16")


def pack_k_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight (K even) → [N/16 blocks, K/2, 16, 2]: each 64-byte row holds a pair of
    consecutive k for 16 output columns, the operand VDPBF16PS takes. N is padded to a
    whole block with zero rows."""
    n, k = weight.shape
    blocks = -(-n // 16)
    padded = torch.zeros(blocks * 16, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight.detach()
    return padded.view(blocks, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight → an opaque oneDNN-packed tensor for _linear_pointwise."""
    # Any batch-size hint picks a layout that runs prefill-sized inputs (128 rows) ~20%
    # faster than the hint-less default, and decode sizes no slower (measured, torch 2.13).
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


class PackedLinear:
    """x [T, in] → x @ weight.T + bias, through whichever kernel this machine uses."""

    __slots__ = ("bias", "out_features", "own_kernel", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features = weight.shape[0]
        self.own_kernel = uses_own_kernel() and weight.shape[1] % 2 == 0
        if self.own_kernel:
            self.weight = pack_k_pairs(weight)
            self.bias = None if bias is None else bias.detach().float().contiguous()
        else:
            self.weight = pack_onednn(weight)
            self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_kernel:
            return torch.ops.plugserve_gemm.linear_bf16(
                x, self.weight, self.out_features, self.bias
            )
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


# Below this many tokens the MLP keeps one fused gate-up matmul and separate passes.
FUSED_MLP_MIN_TOKENS = 128


class FusedMLP:
    """down(silu(gate(x)) * up(x)) in three oneDNN matmuls, SiLU and * up as post-ops."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate = pack_onednn(gate.contiguous())
        self.up = pack_onednn(up.contiguous())
        self.down = pack_onednn(down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.mkldnn
        activated = ops._linear_pointwise(x, self.gate, None, "swish", [], "")
        hidden = ops._linear_pointwise.binary(x, activated, self.up, None, "mul")
        return ops._linear_pointwise(hidden, self.down, None, "none", [], "")
