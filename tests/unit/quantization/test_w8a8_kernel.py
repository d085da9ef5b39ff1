"""The W8A8 int8 kernels (plugins/linear_methods/int8_w8a8.cpp) against integer arithmetic.

Activations are quantized per row to uint8 codes with a scale and a zero point, each value
within half a step of its code. Every kernel this machine offers (VNNI's one-row stream
and register tiles, AMX-INT8 tiles, torch._int_mm) sums the codes times the int8 weights
exactly, and dequantizes the sums alike: every kernel gives the same bits, and its fp32 output is the exact integer sum
(computed here in int64) less the zero point times the weight row's sum, times the two
scales, within the rounding of those two products (an integer off by one would be off by
the product of the scales, some thousand times more).
"""

from __future__ import annotations

import pytest
import torch

from plugserve_plugins.linear_methods import int8_w8a8, w8a8_plan
from plugserve_plugins.linear_methods.int8_w8a8 import Int8W8A8, W8A8Linear
from plugserve_plugins.linear_methods.int8_weight_only import quantize_rows
from tests.kernel_support import missing_cpu_flags

# Skipped only where the CPU lacks the kernel's instructions: where it has them, a kernel
# that does not build fails these tests (and tests/unit/ops/test_kernels_build.py).
MISSING = missing_cpu_flags(int8_w8a8.REQUIRED_CPU_FLAGS)
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"the W8A8 kernel needs a CPU with {' and '.join(MISSING)}"
)
KERNELS = (w8a8_plan.VNNI, w8a8_plan.VNNI_TILED, w8a8_plan.AMX, w8a8_plan.INT_MM)


def quantize(x: torch.Tensor, padded_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    Int8W8A8.unavailable_reason()  # builds and loads the library
    return torch.ops.plugserve_w8a8.quantize_per_token(x, padded_k)


def test_each_activation_is_within_half_a_step_of_its_code_and_zero_is_a_code() -> None:
    torch.manual_seed(0)
    x = torch.cat(
        [
            torch.randn(3, 100) * 3 + 1,
            torch.zeros(1, 100),
            torch.rand(1, 100) + 0.5,  # all positive: the range is widened to hold 0
        ]
    ).bfloat16()
    xq, scale, zero = quantize(x, 128)
    assert xq.dtype == torch.uint8 and xq.shape == (5, 128)
    assert (xq[:, 100:] == 0).all()  # the padding, which meets zero weights
    assert ((zero >= 0) & (zero <= 255)).all()
    rebuilt = (xq[:, :100].float() - zero[:, None]) * scale[:, None]
    assert ((rebuilt - x.float()).abs() <= scale[:, None] * (0.5 + 1e-4)).all()
    assert (rebuilt[3] == 0).all()
    assert zero[4] == 0  # min 0: the codes use the whole range above it


def exact_reference(linear: W8A8Linear, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The fp32 output the kernels must give: exact integer sums (int64 here) times the
    product of the scales."""
    xq, x_scale, x_zero = quantize(x, linear.packed.shape[1] * 4)
    q, w_scale = quantize_rows(weight)
    assert torch.equal(w_scale, linear.scale)
    k = weight.shape[1]
    sums = xq[:, :k].long() @ q.long().T - x_zero.long()[:, None] * q.long().sum(1)[None, :]
    return sums.float() * (x_scale[:, None] * w_scale[None, :])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("in_features", [576, 100])
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 300])
def test_each_kernel_sums_exactly_in_int32(kernel: str, rows: int, in_features: int) -> None:
    if kernel not in {k for bucket in w8a8_plan.candidates_here() for k in bucket}:
        pytest.skip(f"{kernel} does not run here")
    torch.manual_seed(rows * in_features)
    out_features = 197  # not a multiple of the kernels' 16-column blocks
    weight = torch.randn(out_features, in_features).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    linear = Int8W8A8().quantize(weight)

    reference = exact_reference(linear, weight, x)
    got = linear.run(kernel, x, torch.float32)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, reference, rtol=2.5e-7, atol=0)
    # The same bits as the VNNI kernel, which runs every row count wherever one runs here.
    assert torch.equal(got, linear.run(w8a8_plan.VNNI, x, torch.float32))
    assert torch.equal(linear.run(kernel, x, torch.bfloat16), got.bfloat16())


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_bias_is_added_to_the_dequantized_sums(kernel: str) -> None:
    if kernel not in {k for bucket in w8a8_plan.candidates_here() for k in bucket}:
        pytest.skip(f"{kernel} does not run here")
    torch.manual_seed(1)
    weight, bias = torch.randn(48, 64).bfloat16(), torch.randn(48).bfloat16()
    x = torch.randn(20, 64).bfloat16()
    linear = Int8W8A8().quantize(weight, bias)
    expected = exact_reference(linear, weight, x) + bias.float()
    torch.testing.assert_close(linear.run(kernel, x, torch.float32), expected)


def test_fp32_activations_and_leading_dims_run_as_bf16_ones_do() -> None:
    torch.manual_seed(2)
    weight = torch.randn(64, 96).bfloat16()
    linear = Int8W8A8().quantize(weight)
    x = torch.randn(2, 3, 96)
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 64)
    expected = exact_reference(linear, weight, x.view(6, 96))
    torch.testing.assert_close(out.view(6, 64), expected, rtol=2.5e-7, atol=0)


def test_the_dequantized_weight_is_the_weight_within_half_a_step() -> None:
    torch.manual_seed(3)
    weight = torch.randn(40, 100)
    linear = Int8W8A8().quantize(weight)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((linear.dequantized() - weight).abs() <= step / 2 + 1e-7).all()
