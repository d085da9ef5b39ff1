"""How the candidates' times become a plan: the fastest per bucket, no copy of the
weights that does not earn its time, and one row-invariant kernel for the
batch-invariant mode."""

from __future__ import annotations

from plugserve_plugins.cpu_bf16 import plan_rules
from plugserve_plugins.cpu_bf16.kernel_plan import (
    KERNELS_BY_NAME,
    ONEDNN,
    OWN_AMX,
    OWN_TILED,
    ROW_BUCKETS,
    Kernel,
    KernelPlan,
)


def _times(*buckets: dict[Kernel, float]) -> list[dict[str, float | None]]:
    return [{kernel.name: ms for kernel, ms in bucket.items()} for bucket in buckets]


def test_a_further_copy_of_the_weights_is_kept_only_where_it_earns_its_gain() -> None:
    """Each layout a plan reads is a copy of the weights in memory: one the fastest
    kernels would add is dropped where every bucket reading it has a kernel on the other
    layouts within layout_gain of its time."""
    own, coded, onednn = KERNELS_BY_NAME["own"], KERNELS_BY_NAME["own/coded"], ONEDNN
    fused = KERNELS_BY_NAME["onednn/fused-mlp"]
    times = _times(
        {coded: 0.97, own: 1.0},  # the coded copy saves 3 %
        {own: 1.0, onednn: 1.5},
        {own: 3.0, onednn: 3.2},
        {own: 40.0, onednn: 20.0, fused: 19.5},  # oneDNN saves half; its fused MLP 2.5 %
        {own: 400.0, onednn: 210.0, fused: 200.0},  # the fused MLP 5 %
    )
    prefill = [own, onednn, fused]
    candidates = [[coded, own], [own, onednn], [own, onednn], prefill, prefill]
    fastest = KernelPlan((coded, own, own, fused, fused))
    assert plan_rules.choose(times, candidates) == fastest
    assert fastest.layouts() == {"packed", "coded", "onednn", "fused_gate_up"}
    lean = plan_rules.choose(times, candidates, layout_gain=0.05)
    assert lean == KernelPlan((own, own, own, onednn, onednn))
    assert lean.layouts() == {"packed", "onednn"}
    # Where the coded copy saves a fifth of a one-row step, it stays.
    times[0] = {coded.name: 0.8, own.name: 1.0}
    assert plan_rules.choose(times, candidates, layout_gain=0.05).by_bucket[0] == coded


def test_a_layout_stays_where_a_bucket_reading_it_has_no_timed_alternative() -> None:
    """A bucket left with its one survivor (the others lost a smaller bucket) says nothing
    about what dropping its layout would cost: the layout stays."""
    own, onednn = KERNELS_BY_NAME["own"], ONEDNN
    times = _times({own: 1.0}, {own: 1.0, onednn: 1.01}, {own: 3.0, onednn: 3.02}, {}, {})
    times[3] = {onednn.name: None}
    times[4] = {onednn.name: None}
    candidates = [[own], [own, onednn], [own, onednn], [own, onednn], [own, onednn]]
    plan = plan_rules.choose(times, candidates, layout_gain=0.05)
    assert plan == KernelPlan((own, own, own, onednn, onednn))


def test_the_mode_takes_one_kernel_for_every_bucket_weighing_each_bucket_by_its_best() -> None:
    # AMX tiles 10% behind in the three decode buckets and twice as fast in the two
    # prefill ones: over each bucket's best, 3 x 1.1 + 2 x 1.0 against 3 x 1.0 + 2 x 2.0.
    times = [
        {OWN_TILED.name: 1.0, OWN_AMX.name: 1.1},
        {OWN_TILED.name: 1.0, OWN_AMX.name: 1.1},
        {OWN_TILED.name: 3.0, OWN_AMX.name: 3.3},
        {OWN_TILED.name: 40.0, OWN_AMX.name: 20.0},
        {OWN_TILED.name: 400.0, OWN_AMX.name: 200.0},
    ]
    kernels = [OWN_TILED, OWN_AMX]
    assert plan_rules.choose_single(times, kernels) == KernelPlan.single(OWN_AMX)
    # Far ahead at decode, a little behind at prefill: the decode buckets decide.
    times = [
        {OWN_TILED.name: 1.0, OWN_AMX.name: 3.0},
        {OWN_TILED.name: 1.0, OWN_AMX.name: 3.0},
        {OWN_TILED.name: 3.0, OWN_AMX.name: 6.0},
        {OWN_TILED.name: 22.0, OWN_AMX.name: 20.0},
        {OWN_TILED.name: 220.0, OWN_AMX.name: 200.0},
    ]
    assert plan_rules.choose_single(times, kernels) == KernelPlan.single(OWN_TILED)
    assert len(times) == len(ROW_BUCKETS)
