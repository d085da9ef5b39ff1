"""A bf16 linear layer's weight laid out once, at load, for every kernel its plan runs, and
called through the one its row count gets (kernel_plan.py: the buckets and the plan;
kernel_choice.py: the plan measured per machine). Four kernel libraries:

- cpu_gemm.cpp, on CPUs with AVX512_BF16: VDPBF16PS over the k-pair-interleaved copy
  (weight_arena.pack_k_pairs), streaming the weights at the memory bandwidth at decode
  sizes, where oneDNN does not. Sums run in another order than `F.linear`'s, so results
  differ from it by fp32 rounding before the bf16 store. One row can read a lossless
  exponent-coded copy (exponent_coding.py). On AMX CPUs the same packed weights also run
  on AMX tiles (cpu_gemm_amx.h).
- cpu_gemm_fma.cpp, on CPUs with AVX2 and FMA (16-float vectors where AVX-512F is there):
  the weight in panels of two vectors' columns (core's cpu_fma_tiles.h), widened to fp32
  in registers, products and sums in fp32, rounded to bf16 at the store. The kernel of
  CPUs without AVX512_BF16, and of those whose fp32 FMA outruns their VDPBF16PS.
- oneDNN: the weight is reordered once into oneDNN's blocked layout, since `F.linear`
  re-lays out a bf16 weight on every call; bit-identical to `F.linear`. On AMX CPUs its
  tile kernels run batches and prefill.
- ATen's `F.linear` over the weight as loaded.

float32 is never packed here: it runs the cpu_fp32 linear method (plugins/linear_methods).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F

from plugserve.ops.kernel_timing import bucket_index
from plugserve_plugins.cpu_bf16.cpu_features import (
    fma_kernel_unavailable_reason,
    onednn_bf16_supported,
    own_kernel_unavailable_reason,
)
from plugserve_plugins.cpu_bf16.exponent_coding import code_exponents, exponent_codable
from plugserve_plugins.cpu_bf16.kernel_plan import AMX, KERNELS_BY_NAME, Kernel, KernelPlan
from plugserve_plugins.cpu_bf16.kernel_setting import default_plan
from plugserve_plugins.cpu_bf16.weight_arena import WeightArena, pack_k_pairs, packs_k_pairs


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16 weights of this dtype on this device are packed for a kernel here
    (cpu_gemm.cpp, cpu_gemm_fma.cpp or oneDNN); elsewhere the layers keep F.linear."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and (
            own_kernel_unavailable_reason() is None
            or fma_kernel_unavailable_reason() is None
            or onednn_bf16_supported()
        )
    )


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight → an opaque oneDNN-packed tensor for _linear_pointwise."""
    # A batch-size hint picks a layout that runs prefill-sized inputs faster than the
    # hint-less default, and decode sizes no slower (docs/benchmarks-history.md, "bf16 CPU
    # kernels by row count").
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


class PackedLinear:
    """x [T, in] → x @ weight.T + bias, each call through the kernel that `plan` gives its
    row count (default_plan where None). Holds the layout of every kernel the plan uses,
    or of every kernel in `kernels` where given (to time them with `run`): cpu_gemm's
    k-pair-packed copy (in `arena` where given) and its exponent-coded one,
    cpu_gemm_fma's panels, oneDNN's blocked one, or the weight as loaded for ATen. Where
    cpu_gemm cannot take the weight (an odd number of inputs), its buckets run oneDNN, else
    ATen."""

    __slots__ = (
        "_calls",
        "bias",
        "coded",
        "fma_weight",
        "in_features",
        "onednn_weight",
        "out_features",
        "own_bias",
        "plain_weight",
        "plan",
        "weight",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        arena: WeightArena | None = None,
        plan: KernelPlan | None = None,
        kernels: Collection[Kernel] | None = None,
    ) -> None:
        self.out_features, in_features = weight.shape
        self.in_features = in_features
        own_runs = packs_k_pairs(weight.dtype, weight.device, in_features)
        plan = _runnable_plan(plan or default_plan(), own_runs, in_features)
        self.plan = plan
        kernels = plan.by_bucket if kernels is None else kernels
        wanted = {_runnable(k, own_runs, in_features) for k in kernels}
        libraries = {kernel.library for kernel in wanted}
        self.bias = bias
        self.weight: torch.Tensor | None = None  # cpu_gemm's k-pair layout
        # The fp32 bias both C++ kernels add to their sums.
        self.own_bias: torch.Tensor | None = None
        if bias is not None and libraries & {"own", "fma"}:
            self.own_bias = bias.detach().float().contiguous()
        self.coded: torch.Tensor | None = None
        if "own" in libraries:
            out = None if arena is None else arena.take(self.out_features, in_features)
            self.weight = pack_k_pairs(weight, out)
            if any(kernel.coded for kernel in wanted):
                coded = self._coded_room(arena, in_features)
                if coded is not None or (arena is None and exponent_codable(in_features)):
                    self.coded = code_exponents(self.weight, coded)
        self.fma_weight: torch.Tensor | None = None
        if "fma" in libraries:
            self.fma_weight = torch.ops.plugserve_gemm_fma.pack_weight(weight.detach())
        self.onednn_weight = pack_onednn(weight) if "onednn" in libraries else None
        self.plain_weight = weight.detach() if "aten" in libraries else None
        self._calls = tuple(self._call_for(kernel) for kernel in plan.by_bucket)

    def _coded_room(self, arena: WeightArena | None, in_features: int) -> torch.Tensor | None:
        return None if arena is None else arena.take_coded(self.out_features, in_features)

    @property
    def own_kernel(self) -> bool:
        """Whether this weight has cpu_gemm's layout (which the fused decoder reads)."""
        return self.weight is not None

    def _call_for(self, kernel: Kernel) -> Callable[..., torch.Tensor]:
        if kernel.library == "own":
            linear_bf16 = torch.ops.plugserve_gemm.linear_bf16
            weight, n, bias, mode = (
                self.weight,
                self.out_features,
                self.own_bias,
                kernel.one_row_mode,
            )
            coded = self.coded if kernel.coded else None
            return lambda x, out_dtype=None: linear_bf16(x, weight, n, bias, out_dtype, coded, mode)
        if kernel.library == "fma":
            fma_linear = torch.ops.plugserve_gemm_fma.linear_bf16
            panels, n, bias = self.fma_weight, self.out_features, self.own_bias
            return lambda x, out_dtype=None: fma_linear(x, panels, n, bias, out_dtype)
        if kernel.library == "onednn":
            pointwise, onednn_weight, bias = (
                torch.ops.mkldnn._linear_pointwise,
                self.onednn_weight,
                self.bias,
            )

            def onednn(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
                out = pointwise(x, onednn_weight, bias, "none", [], "")
                return out if out_dtype is None else out.to(out_dtype)

            return onednn
        plain, bias = self.plain_weight, self.bias

        def aten(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
            out = F.linear(x, plain, bias)
            return out if out_dtype is None else out.to(out_dtype)

        return aten

    def run(
        self, kernel: Kernel, x: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x through `kernel` whatever the plan says (a kernel whose layout this holds; as
        at construction, one that cannot take this weight stands in for another)."""
        own_runs = self.weight is not None
        return self._call_for(_runnable(kernel, own_runs, self.in_features))(x, out_dtype)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype=torch.float32 asks for fp32 (the LM head's logits): cpu_gemm writes its
        sums unrounded, the others' bf16 result is converted."""
        return self._calls[bucket_index(x.shape[0])](x, out_dtype)


def _runnable(kernel: Kernel, own_runs: bool, in_features: int) -> Kernel:
    """`kernel`, or where it is cpu_gemm's and cpu_gemm cannot take the weight, oneDNN
    (ATen where oneDNN has no bf16 kernel); AMX tiles where K is no multiple of 32, the
    vector kernel."""
    if kernel.library != "own":
        return kernel
    if not own_runs:
        return KERNELS_BY_NAME["onednn" if onednn_bf16_supported() else "aten"]
    if kernel.one_row_mode == AMX and in_features % 32 != 0:
        return KERNELS_BY_NAME["own"]
    return kernel


def _runnable_plan(plan: KernelPlan, own_runs: bool, in_features: int) -> KernelPlan:
    return KernelPlan(tuple(_runnable(k, own_runs, in_features) for k in plan.by_bucket))
