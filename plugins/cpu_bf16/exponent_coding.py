"""The lossless exponent-coded copy of a k-pair-packed bf16 weight, which one-row matmuls
may read instead of the plain one: 12 bits a weight instead of 16, decoded in registers
to the same bf16 values and summed in the same order, so the results are the plain
kernel's bit for bit (the record layout: cpu_gemm.h, row_block_coded).

A trained model's bf16 weights use few exponents, and the 16 columns of one packed block
rarely more than 16 of them: each block gets a table of its exponents and each weight a
4-bit index into it plus a byte of sign and mantissa. A block that uses more is marked
uncoded and holds its first k-pairs plain, as many as its record has room for, the rest
read from the plain packed weight.
"""

from __future__ import annotations

import torch

from plugserve_plugins.cpu_bf16.cpu_features import own_kernel_unavailable_reason

# Per 16-column block a 64-byte table of its exponents, then 96 bytes per two k-pairs.
CODED_TABLE_BYTES = 64
CODED_GROUP_BYTES = 96


def coded_block_bytes(in_features: int) -> int:
    """Bytes of one 16-column block's record, for a weight of `in_features` inputs."""
    return CODED_TABLE_BYTES + in_features // 4 * CODED_GROUP_BYTES


def coded_bytes(out_features: int, in_features: int) -> int:
    """Bytes of a whole weight's coded copy."""
    return -(-out_features // 16) * coded_block_bytes(in_features)


def exponent_codable(in_features: int) -> bool:
    """Whether a weight with this many input features can have an exponent-coded copy
    (whole groups of two k-pairs)."""
    return in_features % 4 == 0


def code_exponents(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A k-pair-packed bf16 weight [N/16, K/2, 16, 2] (K divisible by 4) → its lossless
    exponent-coded copy, uint8 [N/16, coded_block_bytes(K)]. Written into `out` where
    given."""
    if (reason := own_kernel_unavailable_reason()) is not None:
        raise RuntimeError(
            f"exponent-coded weights need cpu_gemm.cpp, which cannot run here: {reason}"
        )
    blocks, pairs = packed.shape[0], packed.shape[1]
    if out is None:
        out = torch.empty(blocks, coded_block_bytes(2 * pairs), dtype=torch.uint8)
    torch.ops.plugserve_gemm.code_exponents(packed, out)
    return out
