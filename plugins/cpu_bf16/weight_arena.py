"""cpu_gemm.cpp's layout of a bf16 weight (k-pairs interleaved for VDPBF16PS and AMX
tiles), and the arena a model's packed weights lie in: one huge-page buffer, handed out
in the order a step reads the weights, so that a step streams it front to back.
"""

from __future__ import annotations

import math

import torch

from plugserve.ops import huge_page_buffer
from plugserve_plugins.cpu_bf16.cpu_features import own_kernel_unavailable_reason
from plugserve_plugins.cpu_bf16.exponent_coding import coded_bytes, exponent_codable
from plugserve_plugins.cpu_bf16.kernel_plan import KernelPlan
from plugserve_plugins.cpu_bf16.kernel_setting import default_plan


def k_pairs_shape(out_features: int, in_features: int) -> tuple[int, int, int, int]:
    return (-(-out_features // 16), in_features // 2, 16, 2)


def pack_k_pairs(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] weight (K even) → [N/16 blocks, K/2, 16, 2]: each 64-byte row holds a pair of
    consecutive k for 16 output columns, the operand VDPBF16PS takes. N is padded to a
    whole block with zero rows. Written into `out` (that shape) where given."""
    n, k = weight.shape
    blocks = -(-n // 16)
    padded = torch.zeros(blocks * 16, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight.detach()
    pairs = padded.view(blocks, 16, k // 2, 2).permute(0, 2, 1, 3)
    return pairs.contiguous() if out is None else out.copy_(pairs)


def packs_k_pairs(dtype: torch.dtype, device: torch.device, in_features: int) -> bool:
    """Whether cpu_gemm.cpp can run a weight of this kind (else oneDNN or ATen do)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and in_features % 2 == 0
        and own_kernel_unavailable_reason() is None
    )


class WeightArena:
    """One huge-page buffer for a model's k-pair-packed weights, handed out in the order
    they are packed (a step's order, so one step reads the buffer front to back), and
    optionally a second one for their exponent-coded copies, in the same order."""

    def __init__(self, weight_shapes: list[tuple[int, int]], coded: bool = False) -> None:
        numel = sum(math.prod(k_pairs_shape(*shape)) for shape in weight_shapes)
        self._buffer = huge_page_buffer(2 * numel).view(torch.bfloat16)
        self._offset = 0
        total_coded = sum(
            coded_bytes(*shape) for shape in weight_shapes if exponent_codable(shape[1])
        )
        self._coded = huge_page_buffer(total_coded) if coded and total_coded else None
        self._coded_offset = 0

    @classmethod
    def for_weights(
        cls, weights: list[torch.Tensor], plan: KernelPlan | None = None
    ) -> WeightArena | None:
        """An arena for the weights `plan` (default_plan where None) runs on cpu_gemm, with
        their coded copies where its one-row kernel reads them; None where it packs none
        (oneDNN and ATen keep their own layouts)."""
        plan = plan or default_plan()
        shapes = [
            (w.shape[0], w.shape[1])
            for w in weights
            if "own" in plan.libraries() and packs_k_pairs(w.dtype, w.device, w.shape[1])
        ]
        return cls(shapes, coded=plan.coded) if shapes else None

    def packed(self) -> torch.Tensor:
        """Every weight handed out so far, as one bf16 tensor: what a batch-1 step reads
        without coded copies (the bf16 bytes its floor is measured on)."""
        return self._buffer[: self._offset]

    def take(self, out_features: int, in_features: int) -> torch.Tensor:
        shape = k_pairs_shape(out_features, in_features)
        numel = math.prod(shape)
        if self._offset + numel > self._buffer.numel():
            raise ValueError(f"weight arena full: no room for a {shape} packed weight")
        view = self._buffer[self._offset : self._offset + numel].view(shape)
        self._offset += numel
        return view

    def take_coded(self, out_features: int, in_features: int) -> torch.Tensor | None:
        """Room for this weight's coded copy; None where the arena holds none or the weight
        cannot be coded."""
        if self._coded is None or not exponent_codable(in_features):
            return None
        size = coded_bytes(out_features, in_features)
        if self._coded_offset + size > self._coded.numel():
            raise ValueError("weight arena full: no room for a coded weight")
        view = self._coded[self._coded_offset : self._coded_offset + size]
        self._coded_offset += size
        return view.view(-(-out_features // 16), -1)
