"""fp32 linears on a CPU through oneDNN's matmul, each weight reordered once, after
loading, into the blocked layout that matmul reads (torch.ops.mkldnn, in torch's CPU
build). F.linear hands the weight as loaded to a GEMM that packs its panels again at
every call; at an encoder's or a prefill's row counts the reordered weight runs the same
sums faster (docs/benchmarks-history.md, "Encoders in fp32").

Which of the two runs is measured, not assumed: under `kernel: auto` the method times
both once on the model's own weights (one of each shape), at a prefill's and at one
row's count, logs the timings and keeps the faster in total; `onednn` and `aten` pin
one (PLUGSERVE_CPU_FP32_KERNEL sets the default where stack.yaml does not: the tests pin
it, so that no outcome hangs on a timing). The plain method (F.linear over the weights
as loaded) stays the one that matches
Hugging Face bit for bit; oneDNN sums in another order, a few fp32 ulps apart.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Literal

import pydantic
import torch
import torch.nn.functional as F
from torch import nn

from plugserve.interfaces.model import LinearLayer, TiedLmHead
from plugserve.ops.kernel_timing import median_ms_in_turns
from plugserve.worker.layers.plain_linear import PlainLinearMethod

logger = logging.getLogger(__name__)

# The kernel when the plugin's options do not name one (auto where unset).
KERNEL_ENV = "PLUGSERVE_CPU_FP32_KERNEL"
# The row counts the timing runs each matmul at: a prefill's (or an encoder step's) and a
# decode's.
TIMING_ROWS = (64, 1)


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


class CpuFp32LinearMethod(PlainLinearMethod):
    """interfaces.model.LinearMethod for fp32 on a CPU: loads like the plain method, then
    runs every layer through oneDNN where that is the kernel chosen, else keeps F.linear."""

    class Options(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        # auto: whichever timed faster on the model's matmuls; onednn or aten: that one.
        kernel: Literal["auto", "onednn", "aten"] = pydantic.Field(
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
        if self.kernel == "aten":
            return
        for layer in layers:
            layer.install(OneDnnLinear(layer.weight, layer.matmul_bias))  # type: ignore[attr-defined]

    def _choose(self, weights: list[torch.Tensor]) -> str:
        choice = self.options.kernel
        if choice != "aten" and not onednn_available():
            if choice == "onednn":
                raise ValueError("cpu_fp32 kernel 'onednn' needs a torch built with oneDNN")
            return "aten"
        if choice != "auto":
            return choice
        faster, timings = onednn_is_faster(weights)
        logger.info("fp32 linears: %s", timings)
        return "onednn" if faster else "aten"

    def describe(self) -> str:
        if self.kernel == "onednn":
            return "fp32 linears: oneDNN (weights reordered once)"
        return "fp32 linears: ATen (weights as loaded)"


def onednn_is_faster(weights: Sequence[torch.Tensor]) -> tuple[bool, str]:
    """Times one pass over `weights`' distinct shapes (the first weight of each, at each row
    count of TIMING_ROWS) through oneDNN's reordered copies and through F.linear, in turns;
    returns whether oneDNN's total was the smaller, and both for the log."""
    first_of_shape = {tuple(w.shape): w for w in reversed(weights)}
    plain = [w.detach() for w in first_of_shape.values()]
    reordered = [OneDnnLinear(w, None) for w in plain]
    generator = torch.Generator().manual_seed(0)
    inputs = [
        (i, torch.randn(rows, w.shape[1], generator=generator))
        for rows in TIMING_ROWS
        for i, w in enumerate(plain)
    ]

    def one_pass(matmul: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        for i, x in inputs:
            matmul(i, x)

    runs = {
        "oneDNN": lambda: one_pass(lambda i, x: reordered[i](x)),
        "ATen": lambda: one_pass(lambda i, x: F.linear(x, plain[i])),
    }
    medians = median_ms_in_turns(list(runs), lambda name: runs[name](), rounds=7)
    faster = medians["oneDNN"] < medians["ATen"]
    return faster, (
        f"oneDNN {medians['oneDNN']:.2f} ms, ATen {medians['ATen']:.2f} ms a pass over "
        f"{len(plain)} weight shapes at {' and '.join(map(str, TIMING_ROWS))} rows; using "
        f"{'oneDNN' if faster else 'ATen'}"
    )
