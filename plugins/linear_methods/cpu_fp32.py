"""fp32 linears on a CPU, through one of three kernels:
- onednn: oneDNN's matmul, each weight reordered once, after loading, into the blocked
  layout that matmul reads (torch.ops.mkldnn, in torch's CPU build). F.linear hands the
  weight as loaded to a GEMM that packs its panels again at every call; at an encoder's or
  a prefill's row counts the reordered weight runs the same sums faster
  (docs/benchmarks-history.md, "Encoders in fp32").
- fma: cpu_fp32_gemm.cpp's FMA register tiles (core's cpu_fma_tiles.h: AVX-512F's
  16-float vectors, else AVX2's 8) over a weight packed once into panels. On a CPU without
  AVX-512, oneDNN runs small row counts well below the cores' FMA rate
  (docs/benchmarks-history.md, "fp32 on AVX2").
- aten: F.linear over the weights as loaded.

Which one runs is measured, not assumed: under `kernel: auto` the method times every
kernel this machine has once on the model's own weights (one of each shape), at a
prefill's and at one row's count, in turns, logs the timings and keeps the fastest in
total; `onednn`, `fma` and `aten` pin one (PLUGSERVE_CPU_FP32_KERNEL sets the default
where stack.yaml does not: the tests pin it, so that no outcome hangs on a timing). The
plain method (F.linear over the weights as loaded) stays the one that matches Hugging
Face bit for bit; the other kernels sum in another order, a few fp32 ulps apart.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import pydantic
import torch
import torch.nn.functional as F
from torch import nn

from plugserve import ops
from plugserve.interfaces.model import LinearLayer, TiedLmHead
from plugserve.ops.kernel_timing import median_ms_in_turns
from plugserve.worker.layers.plain_linear import PlainLinearMethod

logger = logging.getLogger(__name__)

# The kernel when the plugin's options do not name one (auto where unset).
KERNEL_ENV = "PLUGSERVE_CPU_FP32_KERNEL"
# The row counts the timing runs each matmul at: a prefill's (or an encoder step's) and a
# decode's.
TIMING_ROWS = (64, 1)
# The kernels by the names the option takes, in the order the log lists them.
KERNELS = ("onednn", "fma", "aten")
KERNEL_LABELS = {"onednn": "oneDNN", "fma": "FMA tiles", "aten": "ATen"}

_FMA_SOURCE = Path(__file__).with_name("cpu_fp32_gemm.cpp")
# The instructions cpu_fp32_gemm.cpp is written in (-march=native builds them).
FMA_REQUIRED_CPU_FLAGS = ("avx2", "fma")


def onednn_available() -> bool:
    """Whether this torch carries oneDNN's linear ops (its CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDnnLinear:
    """x [..., in] → x @ weight.T + bias through oneDNN, the weight reordered once
    (interfaces.model.LinearCompute)."""

    __slots__ = ("bias", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return out if out_dtype is None else out.to(out_dtype)


def fma_unavailable_reason() -> str | None:
    """None where cpu_fp32_gemm.cpp's kernel runs here (built and loaded), else why not:
    the CPU's missing flags, or the build's or loader's error."""
    missing = [f for f in FMA_REQUIRED_CPU_FLAGS if f not in ops.cpu_flags().split()]
    if missing:
        return f"the CPU lacks {' and '.join(missing)}"
    return ops.unavailable_reason(_FMA_SOURCE)


class FmaLinear:
    """x [..., in] → x @ weight.T + bias through cpu_fp32_gemm.cpp's register tiles, the
    weight packed once into panels (interfaces.model.LinearCompute)."""

    __slots__ = ("bias", "out_features", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = torch.ops.plugserve_fp32.pack_weight(weight.detach())
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.ops.plugserve_fp32.linear(rows, self.weight, self.out_features, self.bias)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if out_dtype is None else out.to(out_dtype)


def available_kernels() -> list[str]:
    """The kernels this machine can run, in KERNELS' order."""
    have = {"onednn": onednn_available(), "fma": fma_unavailable_reason() is None}
    return [k for k in KERNELS if have.get(k, True)]


_COMPUTES: dict[str, Callable[[torch.Tensor, torch.Tensor | None], Callable[..., torch.Tensor]]] = {
    "onednn": OneDnnLinear,
    "fma": FmaLinear,
}


class CpuFp32LinearMethod(PlainLinearMethod):
    """interfaces.model.LinearMethod for fp32 on a CPU: loads like the plain method, then
    runs every layer through the kernel chosen (oneDNN's or the FMA tiles' copy of its
    weight), or keeps F.linear."""

    class Options(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        # auto: whichever timed fastest on the model's matmuls; onednn, fma or aten: that one.
        kernel: Literal["auto", "onednn", "fma", "aten"] = pydantic.Field(
            default_factory=lambda: os.environ.get(KERNEL_ENV, "auto"), validate_default=True
        )

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or self.Options()
        self.kernel: str | None = None  # chosen after loading

    def process_weights_after_loading(
        self,
        layers: Sequence[LinearLayer],
        *,
        model: nn.Module,
        tied_head: TiedLmHead | None,
    ) -> None:
        """A tied LM head keeps F.linear over the embedding's matrix: the lookup needs that
        matrix as it is, and a reordered copy beside it would hold the vocabulary twice."""
        weights = [layer.weight for layer in layers]  # type: ignore[attr-defined]
        unfit = next(
            (w for w in weights if w.dtype != torch.float32 or w.device.type != "cpu"), None
        )
        if unfit is not None:
            raise ValueError(
                f"linear method 'cpu_fp32' runs float32 weights on a CPU, not {unfit.dtype} "
                f"on {unfit.device.type}"
            )
        self.kernel = self._choose(weights)
        compute = _COMPUTES.get(self.kernel)
        if compute is None:
            return
        for layer in layers:
            layer.install(compute(layer.weight, layer.matmul_bias))  # type: ignore[attr-defined]

    def _choose(self, weights: list[torch.Tensor]) -> str:
        choice = self.options.kernel
        if choice == "onednn" and not onednn_available():
            raise ValueError("cpu_fp32 kernel 'onednn' needs a torch built with oneDNN")
        if choice == "fma" and (reason := fma_unavailable_reason()) is not None:
            raise ValueError(f"cpu_fp32 kernel 'fma' cannot run here: {reason}")
        if choice != "auto":
            return choice
        kernels = available_kernels()
        if len(kernels) == 1:
            return kernels[0]
        fastest, timings = fastest_kernel(weights, kernels)
        logger.info("fp32 linears: %s", timings)
        return fastest

    def describe(self) -> str:
        if self.kernel == "onednn":
            return "fp32 linears: oneDNN (weights reordered once)"
        if self.kernel == "fma":
            return "fp32 linears: FMA register tiles (weights packed once)"
        return "fp32 linears: ATen (weights as loaded)"


def fastest_kernel(weights: Sequence[torch.Tensor], kernels: Sequence[str]) -> tuple[str, str]:
    """Times one pass over `weights`' distinct shapes (the first weight of each, at each row
    count of TIMING_ROWS) through each of `kernels` (names of KERNELS), in turns; returns
    the one whose total was the smallest, and every timing for the log."""
    first_of_shape = {tuple(w.shape): w for w in reversed(weights)}
    plain = [w.detach() for w in first_of_shape.values()]
    generator = torch.Generator().manual_seed(0)
    inputs = [
        (i, torch.randn(rows, w.shape[1], generator=generator))
        for rows in TIMING_ROWS
        for i, w in enumerate(plain)
    ]
    matmuls: dict[str, Callable[[int, torch.Tensor], torch.Tensor]] = {}
    for kernel in kernels:
        if kernel == "aten":
            matmuls[kernel] = lambda i, x: F.linear(x, plain[i])
        else:
            computes = [_COMPUTES[kernel](w, None) for w in plain]
            matmuls[kernel] = lambda i, x, computes=computes: computes[i](x)

    def one_pass(kernel: str) -> None:
        matmul = matmuls[kernel]
        for i, x in inputs:
            matmul(i, x)

    medians = median_ms_in_turns(list(kernels), one_pass, rounds=7)
    fastest = min(kernels, key=lambda k: medians[k])
    listed = ", ".join(f"{KERNEL_LABELS[k]} {medians[k]:.2f} ms" for k in kernels)
    return fastest, (
        f"{listed} a pass over {len(plain)} weight shapes at "
        f"{' and '.join(map(str, TIMING_ROWS))} rows; using {KERNEL_LABELS[fastest]}"
    )
