"""The bf16 kernels engine.batch_invariant runs: each gives every row the same bits at
every row count, and the plan it takes is one of them for all buckets."""

from __future__ import annotations

import pytest
import torch

from plugserve_plugins.cpu_bf16 import kernel_choice, packed_linear
from plugserve_plugins.cpu_bf16.kernel_plan import (
    BATCH_INVARIANT_KERNELS,
    OWN,
    ROW_BUCKETS,
    KernelPlan,
)
from plugserve_plugins.cpu_bf16.kernel_setting import KERNEL_ENV

# Row counts in every bucket, on both sides of the 8-row tile, with remainders.
ROW_COUNTS = (1, 2, 5, 8, 9, 33, 64, 65, 130, 257, 300)


@pytest.fixture(params=[k.name for k in BATCH_INVARIANT_KERNELS])
def invariant_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    try:
        here = [k.name for k in kernel_choice.batch_invariant_candidates()[0]]
    except ValueError as exc:
        pytest.skip(str(exc))
    if request.param not in here:
        pytest.skip(f"{request.param} does not run on this CPU")
    return next(k for k in BATCH_INVARIANT_KERNELS if k.name == request.param)


# (64, 2048): x's rows run in L2-sized panels of fewer than 300 rows on AMX tiles.
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (100, 70), (64, 2048)])
def test_every_row_is_the_same_bits_whatever_rows_share_the_call(
    invariant_kernel, out_features: int, in_features: int
) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).float()
    x = torch.randn(max(ROW_COUNTS), in_features, generator=generator).bfloat16()
    linear = packed_linear.PackedLinear(weight, bias, plan=KernelPlan.single(invariant_kernel))
    everything = linear(x)
    for rows in ROW_COUNTS:
        assert torch.equal(linear(x[:rows]), everything[:rows]), f"{rows} rows"
    for row in (0, 7, 299):
        assert torch.equal(linear(x[row : row + 1]), everything[row : row + 1]), f"row {row}"


def test_a_pinned_plan_that_mixes_kernels_is_refused_by_name(
    invariant_kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    mixed = ",".join([OWN.name] + [invariant_kernel.name] * (len(ROW_BUCKETS) - 1))
    monkeypatch.setenv(KERNEL_ENV, mixed)
    weight = torch.randn(64, 64).bfloat16()
    steps = [kernel_choice.LinearStep(weight, None)]
    with pytest.raises(ValueError, match=r"engine\.batch_invariant needs one kernel of"):
        kernel_choice.plan_for(steps, batch_invariant=True)
    monkeypatch.setenv(KERNEL_ENV, ",".join([invariant_kernel.name] * len(ROW_BUCKETS)))
    plan = kernel_choice.plan_for(steps, batch_invariant=True).plan
    assert plan == KernelPlan.single(invariant_kernel)
