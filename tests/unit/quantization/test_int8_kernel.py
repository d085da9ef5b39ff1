"""The int8 weight-only kernel (plugins/linear_methods) against fp32 arithmetic on the weight
it dequantizes to: x @ (q * scale).T + bias.

In fp32 output the kernel computes in fp32 throughout (registers up to 8 rows, an fp32
matmul on dequantized blocks beyond): only the summation order differs from the
reference, tolerance 1e-5 of the output's largest magnitude. In bf16 output, beyond 8 rows
it multiplies bf16-rounded weights (q * scale) in oneDNN's bf16 matmul, and every output
is rounded to bf16: tolerance 1e-2 (measured up to 5.5e-3).
"""

from __future__ import annotations

import pytest
import torch

from plugserve_plugins.linear_methods import int8_weight_only
from plugserve_plugins.linear_methods.int8_weight_only import (
    Int8WeightOnly,
    quantize_rows,
)
from tests.kernel_support import missing_cpu_flags

# Skipped only where the CPU lacks the kernel's instructions: where it has them, a kernel
# that does not build fails these tests (and tests/unit/ops/test_kernels_build.py).
MISSING = missing_cpu_flags(int8_weight_only.REQUIRED_CPU_FLAGS)
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"the int8 kernel needs a CPU with {' and '.join(MISSING)}"
)


def test_quantize_rows_is_symmetric_per_row_absmax_over_127() -> None:
    weight = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [-254.0, 127.0, 1.0]])
    q, scale = quantize_rows(weight)
    assert scale.tolist() == pytest.approx([2 / 127, 1.0, 2.0])
    assert q.dtype == torch.int8
    assert q.tolist() == [[64, -127, 32], [0, 0, 0], [-127, 64, 0]]  # 1 / 2 rounds to even


@pytest.mark.parametrize("in_features", [576, 1536, 100])
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 300])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_dequantized_weight_in_fp32(
    rows: int, in_features: int, out_dtype: torch.dtype
) -> None:
    torch.manual_seed(rows * in_features)
    out_features = 197  # not a multiple of the kernel's 4-row steps or 32-row items
    weight = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    linear = Int8WeightOnly().quantize(weight, bias)

    got = linear(x, out_dtype)
    reference = x.float() @ linear.dequantized().T + bias.float()

    assert got.dtype == out_dtype and got.shape == (rows, out_features)
    tolerance = 1e-5 if out_dtype == torch.float32 else 1e-2
    error = (got.float() - reference).abs().max() / reference.abs().max()
    assert error < tolerance


def test_default_output_dtype_is_the_inputs_and_leading_dims_are_kept() -> None:
    torch.manual_seed(0)
    linear = Int8WeightOnly().quantize(torch.randn(64, 96).bfloat16())
    x = torch.randn(2, 3, 96).bfloat16()
    out = linear(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 64)
    reference = x.float() @ linear.dequantized().T
    assert (out.float() - reference).abs().max() <= 1e-2 * reference.abs().max()


def test_quantization_error_is_bounded_by_half_a_step_per_weight() -> None:
    torch.manual_seed(0)
    weight = torch.randn(32, 576)
    linear = Int8WeightOnly().quantize(weight)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((linear.dequantized() - weight).abs() <= step / 2 + 1e-7).all()
