"""A third-party linear method, the smallest real one: every linear weight of an fp32
model kept in float16, half its memory, and widened to the activations' dtype for each
matmul. Written against plugserve.interfaces (LinearMethod and the LinearLayer it is
given) and `hookimpl` only.

Loaded through PLUGSERVE_PLUGIN_MODULES=tests.plugins.minimal.linear_method;
tests/plugins/test_minimal_plugins.py selects it (stack.linear_method: fp16_weights).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from plugserve import hookimpl
from plugserve.hookspecs import Register
from plugserve.interfaces.model import LinearLayer, TiedLmHead


class HalfPrecisionWeights:
    """interfaces.model.LinearMethod: `weight` and `bias` stored in float16."""

    def create_weights(self, layer: LinearLayer) -> None:
        layer.add_parameter("weight", (layer.out_features, layer.in_features), torch.float16)
        if layer.has_bias:
            layer.add_parameter("bias", (layer.out_features,), torch.float16)

    def load_weight(
        self,
        layer: LinearLayer,
        param: nn.Parameter,
        destination: torch.Tensor,
        loaded: torch.Tensor,
    ) -> None:
        destination.copy_(loaded)  # rounds the checkpoint's values to fp16

    def process_weights_after_loading(
        self, layers: Sequence[LinearLayer], *, model: nn.Module, tied_head: TiedLmHead | None
    ) -> None:
        """Nothing to re-lay out; a tied head keeps the embedding's own matrix."""

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        bias = layer.matmul_bias
        return F.linear(x, layer.weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


@hookimpl
def register_linear_methods(register: Register) -> None:
    register("fp16_weights", HalfPrecisionWeights)
