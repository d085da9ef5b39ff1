"""The plain linear method: the weight as the checkpoint has it, multiplied by F.linear.

Every linear layer is built with it, so a layer computes without a plugin registry (a
model built directly, by a test or a tool), and it is F.linear, bit for bit with Hugging
Face (fp32 on a CPU runs the cpu_fp32 method unless `stack.linear_method: plain` asks
for this one). It lives in the core rather than in plugins/ for that reason: the core
never imports a plugin, and a layer needs a method the moment it exists. It is registered
as the `plain` linear method (plugserve.builtin_linear_methods) like any plugin's, and the
bundled methods that keep the checkpoint's layout until they repack it after loading
derive from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.interfaces.model import LinearLayer, TiedLmHead


class PlainLinearMethod:
    """interfaces.model.LinearMethod: `weight` [out, in] and `bias` [out] in the model's dtype,
    as loaded; F.linear over them."""

    def create_weights(self, layer: LinearLayer) -> None:
        layer.add_parameter("weight", (layer.out_features, layer.in_features))
        if layer.has_bias:
            layer.add_parameter("bias", (layer.out_features,))

    def load_weight(
        self,
        layer: LinearLayer,
        param: nn.Parameter,
        destination: torch.Tensor,
        loaded: torch.Tensor,
    ) -> None:
        destination.copy_(loaded)

    def process_weights_after_loading(
        self,
        layers: Sequence[LinearLayer],
        *,
        model: nn.Module,
        tied_head: TiedLmHead | None,
    ) -> None:
        """Nothing to do: F.linear reads the weights as loaded."""

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.matmul_bias)  # type: ignore[attr-defined]

    def describe(self) -> str:
        return "linears: ATen (weights as loaded)"
