"""From the candidates' times to a kernel plan: each row bucket's fastest kernel, then
no copy of the weights that does not earn its time (choose); or, for
engine.batch_invariant, one row-invariant kernel for every bucket (choose_single).

Times are kernel_choice.Measurement's: per bucket, each candidate's median milliseconds
for one step's matmuls, None for a candidate left untimed in a prefill bucket after
losing a smaller one by LOSER_FACTOR.
"""

from __future__ import annotations

from plugserve_plugins.cpu_bf16.kernel_plan import (
    BATCH_INVARIANT_KERNELS,
    KERNELS_BY_NAME,
    LAYOUT_SHARE,
    Kernel,
    KernelPlan,
    layouts_of,
)

# A candidate this many times slower than a decode bucket's best is not timed in the
# prefill buckets, where it only falls further behind (cpu_gemm's vector kernel against
# AMX tiles), and its long runs would take most of the measuring time. Decode buckets
# time every candidate: one far behind at a few rows may lead at more.
LOSER_FACTOR = 2.5


def choose(
    times: list[dict[str, float | None]],
    candidates: list[list[Kernel]],
    layout_gain: float = 0.0,
) -> KernelPlan:
    """Each bucket's fastest candidate (its survivor, or its only candidate, where it was
    not timed); then, with `layout_gain` > 0, fewer copies of the weights: a layout the
    plan would keep (kernel_plan.layouts_of) is dropped where every bucket that reads it
    has a timed candidate on the layouts kept anyway within `layout_gain` of its time (a
    copy of the weights must earn that much), the largest layouts tried first."""
    chosen = []
    for bucket_times, kernels in zip(times, candidates, strict=True):
        timed = {name: ms for name, ms in bucket_times.items() if ms is not None}
        if timed:
            chosen.append(KERNELS_BY_NAME[min(timed, key=timed.__getitem__)])
        else:
            chosen.append(KERNELS_BY_NAME[next(iter(bucket_times))] if bucket_times else kernels[0])
    plan = KernelPlan(tuple(chosen))
    while layout_gain > 0:
        for layout in sorted(plan.layouts(), key=lambda name: (-LAYOUT_SHARE[name], name)):
            leaner = _without_layout(plan, layout, times, layout_gain)
            if leaner is not None:
                plan = leaner
                break
        else:
            break
    return plan


def _without_layout(
    plan: KernelPlan, layout: str, times: list[dict[str, float | None]], layout_gain: float
) -> KernelPlan | None:
    """`plan` with every bucket that reads `layout` moved to its fastest timed candidate
    on the plan's other layouts, where each such candidate is within `layout_gain` of the
    bucket's time; None where a bucket has none."""
    kept = plan.layouts() - {layout}
    chosen = []
    for kernel, bucket_times in zip(plan.by_bucket, times, strict=True):
        if layout not in layouts_of(kernel):
            chosen.append(kernel)
            continue
        timed = {name: ms for name, ms in bucket_times.items() if ms is not None}
        others = [name for name in timed if layouts_of(KERNELS_BY_NAME[name]) <= kept]
        if kernel.name not in timed or not others:
            return None
        best = min(others, key=timed.__getitem__)
        if timed[best] > (1 + layout_gain) * timed[kernel.name]:
            return None
        chosen.append(KERNELS_BY_NAME[best])
    return KernelPlan(tuple(chosen))


def choose_single(times: list[dict[str, float | None]], kernels: list[Kernel]) -> KernelPlan:
    """One kernel for every bucket: the one whose times, each over its bucket's best, add
    up least (a bucket where a kernel was left untimed as a loser counts LOSER_FACTOR), so
    that the long prefill buckets' milliseconds do not outvote the decode ones."""

    def cost(kernel: Kernel) -> float:
        total = 0.0
        for bucket_times in times:
            timed = {name: ms for name, ms in bucket_times.items() if ms is not None}
            if not timed:
                continue
            ms = timed.get(kernel.name)
            total += LOSER_FACTOR if ms is None else ms / min(timed.values())
        return total

    return KernelPlan.single(min(kernels, key=cost))


def is_batch_invariant(plan: KernelPlan) -> bool:
    """Whether `plan` runs one kernel of BATCH_INVARIANT_KERNELS at every row count."""
    return len(set(plan.by_bucket)) == 1 and plan.by_bucket[0] in BATCH_INVARIANT_KERNELS
