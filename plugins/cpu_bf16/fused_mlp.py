"""A gated MLP as three oneDNN matmuls with SiLU and the product as post-ops, which a
kernel plan may give prefill chunks (the "onednn/fused-mlp" kernel): the activation and
the product are applied to the fp32 accumulators inside the matmuls instead of in
separate bf16 passes over [tokens, intermediate] tensors."""

from __future__ import annotations

import torch

from plugserve_plugins.cpu_bf16.packed_linear import pack_onednn


class FusedMLP:
    """down(silu(gate(x)) * up(x)) over oneDNN's blocked copies of the three weights
    (pack_onednn). The down projection's copy is the one its PackedLinear holds for the
    plan's other oneDNN buckets, shared rather than made twice (from_loaded makes all
    three, where there is none to share)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate, self.up, self.down = gate, up, down

    @classmethod
    def from_loaded(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> FusedMLP:
        return cls(pack_onednn(gate.contiguous()), pack_onednn(up.contiguous()), pack_onednn(down))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.mkldnn
        activated = ops._linear_pointwise(x, self.gate, None, "swish", [], "")
        hidden = ops._linear_pointwise.binary(x, activated, self.up, None, "mul")
        return ops._linear_pointwise(hidden, self.down, None, "none", [], "")
