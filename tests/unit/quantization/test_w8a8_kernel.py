"""The W8A8 int8 kernels (plugins/linear_methods/int8_w8a8.cpp) against integer arithmetic.

Activations are quantized per row to uint8 codes with a scale and a zero point, each value
within half a step of its code, except the row's outliers (more than six times its root
mean square from zero), which are kept exactly and left out of the codes' range. Every
kernel this machine offers (VNNI's one-row stream and register tiles, AMX-INT8 tiles,
torch._int_mm) sums the codes times the int8 weights exactly, and dequantizes the sums
alike: every kernel gives the same bits, and its fp32 output is the exact integer sum
(computed here in int64) less the zero point times the weight row's sum, times the two
scales, within the rounding of those two products (an integer off by one would be off by
the product of the scales, some thousand times more), plus each outlier times its weight.
"""

from __future__ import annotations

import pytest
import torch

from plugserve_plugins.linear_methods import w8a8_plan
from plugserve_plugins.linear_methods.int8_w8a8 import Int8W8A8, W8A8Linear
from plugserve_plugins.linear_methods.int8_weight_only import quantize_rows
from tests.kernel_support import missing_cpu_flags

# Skipped only where the CPU lacks the kernel's instructions: where it has them, a kernel
# that does not build fails these tests (and tests/unit/ops/test_kernels_build.py).
MISSING = missing_cpu_flags(w8a8_plan.REQUIRED_CPU_FLAGS)
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"the W8A8 kernel needs a CPU with {' and '.join(MISSING)}"
)
KERNELS = (w8a8_plan.VNNI, w8a8_plan.VNNI_TILED, w8a8_plan.AMX, w8a8_plan.INT_MM)


OUTLIER_RMS = 6  # int8_w8a8.cpp's kOutlierRms


def quantize(x: torch.Tensor, padded_k: int) -> tuple[torch.Tensor, ...]:
    """(codes, scale, zero point, outlier count, outlier places, outlier values) per row."""
    Int8W8A8.unavailable_reason()  # builds and loads the library
    return torch.ops.plugserve_w8a8.quantize_per_token(x, padded_k)


def with_outliers(rows: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows, each but the first with one to three channels 60-120x larger."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator)
    for m in range(1, rows):
        places = torch.randperm(k, generator=generator)[: 1 + m % 3]
        x[m, places] = (60 + 60 * torch.rand(len(places), generator=generator)) * (
            torch.randint(0, 2, (len(places),), generator=generator) * 2 - 1
        )
    return x.bfloat16()


def test_each_activation_is_within_half_a_step_of_its_code_and_zero_is_a_code() -> None:
    torch.manual_seed(0)
    x = torch.cat(
        [
            torch.randn(3, 100) * 3 + 1,
            torch.zeros(1, 100),
            torch.rand(1, 100) + 0.5,  # all positive: the range is widened to hold 0
        ]
    ).bfloat16()
    xq, scale, zero, outliers, _, _ = quantize(x, 128)
    assert (outliers == 0).all()  # none of these is 6 RMS from zero
    assert xq.dtype == torch.uint8 and xq.shape == (5, 128)
    assert (xq[:, 100:] == 0).all()  # the padding, which meets zero weights
    assert ((zero >= 0) & (zero <= 255)).all()
    rebuilt = (xq[:, :100].float() - zero[:, None]) * scale[:, None]
    assert ((rebuilt - x.float()).abs() <= scale[:, None] * (0.5 + 1e-4)).all()
    assert (rebuilt[3] == 0).all()
    assert zero[4] == 0  # min 0: the codes use the whole range above it


def test_outliers_are_kept_exactly_and_out_of_the_range_of_the_codes() -> None:
    x = with_outliers(6, 300, seed=4)
    xq, scale, zero, outliers, places, values = quantize(x, 320)
    assert places.shape == values.shape == (6, 10)  # room for 320 / 32 a row
    assert outliers[0] == 0 and (outliers[1:] > 0).all()
    for m in range(6):
        far = (x[m].float().abs() > OUTLIER_RMS * x[m].float().pow(2).mean().sqrt()).nonzero()
        n = int(outliers[m])
        assert places[m, :n].tolist() == far.flatten().tolist()  # ascending
        assert torch.equal(values[m, :n], x[m, places[m, :n].long()].float())
        assert (xq[m, places[m, :n].long()] == zero[m]).all()  # no share in the sums
        near = torch.ones(300, dtype=torch.bool)
        near[places[m, :n].long()] = False
        # The step is the rest's: a Gaussian row's range, not the outliers'.
        rest = x[m, near].float()
        assert scale[m] == pytest.approx((rest.max() - rest.min()).item() / 255, rel=1e-5)
        rebuilt = (xq[m, :300][near].float() - zero[m]) * scale[m]
        assert ((rebuilt - rest).abs() <= scale[m] * (0.5 + 1e-4)).all()


def test_an_outlier_is_more_than_six_rms_from_zero_and_every_one_has_room() -> None:
    x = torch.full((3, 320), 0.01)
    x[0, ::40] = 1.0  # eight of 320: each sqrt(40) RMS, more than 6
    x[1, :320:36] = 1.0  # nine, each sqrt(320 / 9) < 6 RMS
    x[2, 5] = 1.0  # one: sqrt(320) RMS
    _, _, _, outliers, places, _ = quantize(x.bfloat16(), 320)
    # Fewer than K / 36 values can pass the bound: room for 320 / 32 = 10.
    assert outliers.tolist() == [8, 0, 1]
    assert places[0, :8].tolist() == list(range(0, 320, 40)) and places[2, 0] == 5


def exact_reference(linear: W8A8Linear, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The fp32 output the kernels must give: exact integer sums (int64 here) times the
    product of the scales, plus each outlier times its quantized weight (float64 here)."""
    xq, x_scale, x_zero, outliers, places, values = quantize(x, linear.packed.shape[1] * 4)
    q, w_scale = quantize_rows(weight)
    assert torch.equal(w_scale, linear.scale)
    k = weight.shape[1]
    sums = xq[:, :k].long() @ q.long().T - x_zero.long()[:, None] * q.long().sum(1)[None, :]
    exact = torch.zeros(x.shape[0], k, dtype=torch.float64)
    for m in range(x.shape[0]):
        n = int(outliers[m])
        exact[m, places[m, :n].long()] = values[m, :n].double()
    kept = (exact @ q.double().T) * w_scale.double()[None, :]
    return (sums.float() * (x_scale[:, None] * w_scale[None, :])).double().add(kept).float()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("in_features", [576, 100])
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 300])
def test_each_kernel_sums_exactly_in_int32(kernel: str, rows: int, in_features: int) -> None:
    if kernel not in {k for bucket in w8a8_plan.candidates_here() for k in bucket}:
        pytest.skip(f"{kernel} does not run here")
    torch.manual_seed(rows * in_features)
    out_features = 197  # not a multiple of the kernels' 16-column blocks
    weight = torch.randn(out_features, in_features).bfloat16()
    # Within 3 of zero, under 6 RMS: no outliers, every product in the integer sums.
    x = torch.randn(rows, in_features).clamp(-3, 3).bfloat16()
    assert (quantize(x, 640)[3] == 0).all()
    linear = Int8W8A8().quantize(weight)

    reference = exact_reference(linear, weight, x)
    got = linear.run(kernel, x, torch.float32)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, reference, rtol=2.5e-7, atol=0)
    # The same bits as the VNNI kernel, which runs every row count wherever one runs here.
    assert torch.equal(got, linear.run(w8a8_plan.VNNI, x, torch.float32))
    assert torch.equal(linear.run(kernel, x, torch.bfloat16), got.bfloat16())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_each_kernel_adds_the_outliers_exactly(kernel: str, rows: int) -> None:
    if kernel not in {k for bucket in w8a8_plan.candidates_here() for k in bucket}:
        pytest.skip(f"{kernel} does not run here")
    in_features, out_features = 576, 197
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(5))
    x = with_outliers(rows + 1, in_features, seed=rows)[1:]
    assert (quantize(x, in_features)[3] > 0).all()  # every row has some
    linear = Int8W8A8().quantize(weight.bfloat16())

    got = linear.run(kernel, x, torch.float32)
    # The fp32 sum over a row's outliers rounds: relative to the output's largest values.
    reference = exact_reference(linear, weight.bfloat16(), x)
    atol = 1e-6 * reference.abs().amax().item()
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=atol)
    assert torch.equal(got, linear.run(w8a8_plan.VNNI, x, torch.float32))
    # Each row alone, as the batch gave it.
    assert torch.equal(linear.run(kernel, x[-1:], torch.float32), got[-1:])


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
