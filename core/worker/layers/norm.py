"""RMSNorm, with the residual add folded in for the fused bf16 CPU op; Gemma's variant."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.worker import cpu_ops
from plugserve.worker.layers.direct_call import direct_call


@direct_call
class RMSNorm(nn.Module):
    """RMSNorm; with `fused` (the model's final norm, bf16 on CPU) one cpu_ops call, which
    also takes the residual add (`add_and_norm`)."""

    fused = False

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). The fused op reuses x's and residual's
        memory for the results: both must be this step's own tensors."""
        if self.fused:
            return cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # HF's LlamaRMSNorm exactly: F.rms_norm without a weight is bit-identical to
            # its formula, and the weight multiplies afterwards.
            return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)
        # Half precision: one fused op (fp32 inside, one rounding at the end) instead of
        # HF's cast, normalize, cast back and multiply: four passes, two roundings.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


@direct_call
class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in fp32 and rounded once to x's
    dtype at the end (transformers' Gemma2RMSNorm/Gemma3RMSNorm exactly; Llama's instead
    rounds before multiplying by the weight, which is stored as is). The residual add is
    RMSNorm's; never the fused CPU op, which multiplies by the weight itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)
