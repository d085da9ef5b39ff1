"""A third-party weight quantization, the smallest real one: every linear weight kept in
float16, half of fp32's memory, and widened to compute.

Loaded through PLUGSERVE_PLUGIN_MODULES=tests.plugins.minimal.quantization;
tests/plugins/test_minimal_plugins.py selects it.
"""

from __future__ import annotations

import torch

from plugserve import hookimpl
from plugserve.hookspecs import Register


class HalfLinear:
    """(x [M, K], out_dtype) → x @ w.T + bias [M, N], computed in fp32 from fp16 weights."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach().to(torch.float16).contiguous()
        self.bias = None if bias is None else bias.detach().float()

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out = torch.nn.functional.linear(x.float(), self.weight.float(), self.bias)
        return out.to(out_dtype or x.dtype)


class HalfPrecisionWeights:
    """interfaces.WeightQuantization: weights stored in float16."""

    def quantize(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> HalfLinear:
        return HalfLinear(weight, bias)


@hookimpl
def register_quantization_methods(register: Register) -> None:
    register("fp16_weights", HalfPrecisionWeights)
