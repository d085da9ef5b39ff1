"""The kernels a test may rely on here.

When a test of a compiled kernel may skip: only where the CPU lacks the instructions the
kernel is written in (or the machine has no C++ compiler). Where both are there, a kernel
that is still unavailable is a broken build, and the test fails with the reason instead of
passing as a skip.

Which bf16 kernel plan the suite runs under: one pinned from what the machine offers,
never timed (pinned_plan); the kernels the chooser may offer, each testable alone."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

import pytest

from plugserve import ops
from plugserve.ops.kernel_timing import ONE_ROW, is_prefill
from plugserve_plugins.cpu_bf16 import kernel_choice
from plugserve_plugins.cpu_bf16.kernel_plan import Kernel, KernelPlan
from plugserve_plugins.cpu_bf16.kernel_setting import KERNEL_ENV


def missing_cpu_flags(flags: Sequence[str]) -> list[str]:
    """The flags in `flags` that this CPU lacks (as plugserve.ops.cpu_flags reports it)."""
    present = set(ops.cpu_flags().split())
    return [flag for flag in flags if flag not in present]


def compiler_missing() -> str | None:
    """Why kernels cannot be built here (no C++ compiler), or None."""
    compiler = os.environ.get("CXX") or "g++"
    return None if shutil.which(compiler) else f"no C++ compiler ({compiler})"


def require_kernel(name: str, flags: Sequence[str], unavailable_reason: str | None) -> None:
    """Skip where this CPU lacks `flags` or there is no compiler; otherwise fail unless the
    kernel `name` built and loaded (`unavailable_reason` is None)."""
    missing = missing_cpu_flags(flags)
    if missing:
        pytest.skip(f"{name} needs a CPU with {' and '.join(missing)}")
    no_compiler = compiler_missing()
    if no_compiler is not None:
        pytest.skip(f"{name} cannot be built: {no_compiler}")
    if unavailable_reason is not None:
        pytest.fail(f"{name} must build and load on this CPU, but: {unavailable_reason}")


def offered_kernels_by_bucket() -> list[list[Kernel]]:
    """Per row bucket, every kernel the chooser may give it on this machine (exponent
    coding on, as served; nothing forced by PLUGSERVE_CPU_BF16_KERNEL)."""
    forced = os.environ.pop(KERNEL_ENV, None)
    try:
        return kernel_choice.candidates_here(coded=True)
    finally:
        if forced is not None:
            os.environ[KERNEL_ENV] = forced


def offered_kernels() -> list[Kernel]:
    """Every kernel the chooser may put in some bucket here, each once."""
    return list(dict.fromkeys(k for bucket in offered_kernels_by_bucket() for k in bucket))


def plan_featuring(kernel: Kernel) -> KernelPlan:
    """`kernel` in every bucket it may run, the first candidate in the others."""
    return KernelPlan(
        tuple(kernel if kernel in bucket else bucket[0] for bucket in offered_kernels_by_bucket())
    )


def pinned_plan() -> KernelPlan:
    """The plan the suite runs under (tests/conftest.py), chosen from what this machine
    offers without timing anything: one-row steps on exponent-coded weights, other decode
    steps on the first candidate (cpu_gemm.cpp where it runs), prefill on oneDNN where it
    runs. So no test's outcome depends on what the machine was doing while kernels were
    timed; each kernel is tested on its own (tests/correctness/test_bf16_matches_hf.py)."""
    chosen = []
    for b, bucket in enumerate(offered_kernels_by_bucket()):
        names = [kernel.name for kernel in bucket]
        preferred = "own/coded" if b == ONE_ROW else "onednn" if is_prefill(b) else names[0]
        chosen.append(bucket[names.index(preferred)] if preferred in names else bucket[0])
    return KernelPlan(tuple(chosen))


def plan_setting(plan: KernelPlan) -> str:
    """`plan` as PLUGSERVE_CPU_BF16_KERNEL names it."""
    return ",".join(kernel.name for kernel in plan.by_bucket)
