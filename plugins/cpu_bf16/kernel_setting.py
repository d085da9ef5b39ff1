"""Which bf16 CPU kernels linears may run here: every one that runs on this machine, or
what PLUGSERVE_CPU_BF16_KERNEL restricts them to or pins (tests force one kernel to run
it where the machine would not pick it; a user may pin a plan without timing it).
"""

from __future__ import annotations

import os

from plugserve_plugins.cpu_bf16.cpu_features import (
    fma_kernel_unavailable_reason,
    onednn_bf16_supported,
    own_kernel_unavailable_reason,
)
from plugserve_plugins.cpu_bf16.kernel_plan import (
    KERNELS_BY_NAME,
    ROW_BUCKETS,
    KernelPlan,
    Library,
)

# Restricts the kernels bf16 linears may run: "own" (cpu_gemm.cpp; an error where it cannot
# run), "fma" (cpu_gemm_fma.cpp; likewise), "onednn", "aten", or "auto" (the default:
# whichever measures fastest, per bucket);
# or sets the plan: one kernel name per row bucket, comma-separated
# ("own/tiled,own,onednn,onednn,onednn/fused-mlp"), unmeasured.
KERNEL_ENV = "PLUGSERVE_CPU_BF16_KERNEL"
_KERNEL_CHOICES = ("auto", "own", "fma", "onednn", "aten")


def _kernel_setting() -> str:
    choice = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if choice not in _KERNEL_CHOICES and "," not in choice:
        raise ValueError(
            f"{KERNEL_ENV}={choice!r}: expected one of {', '.join(_KERNEL_CHOICES)}, or one "
            f"kernel per row bucket ({', '.join(b.name for b in ROW_BUCKETS)}) from "
            f"{', '.join(KERNELS_BY_NAME)}, comma-separated"
        )
    return choice


def forced_plan() -> KernelPlan | None:
    """The plan PLUGSERVE_CPU_BF16_KERNEL sets, where it names one kernel per bucket."""
    choice = _kernel_setting()
    if "," not in choice:
        return None
    names = [name.strip() for name in choice.split(",")]
    unknown = [name for name in names if name not in KERNELS_BY_NAME]
    if len(names) != len(ROW_BUCKETS) or unknown:
        raise ValueError(
            f"{KERNEL_ENV}={choice!r}: expected {len(ROW_BUCKETS)} kernels (rows "
            f"{', '.join(b.name for b in ROW_BUCKETS)}) from {', '.join(KERNELS_BY_NAME)}"
        )
    return KernelPlan(tuple(KERNELS_BY_NAME[name] for name in names))


def allowed_libraries() -> tuple[Library, ...]:
    """The kernel libraries bf16 linears may use here: every one that runs on this machine,
    or the one PLUGSERVE_CPU_BF16_KERNEL names ("own" or "fma" raises a RuntimeError
    naming what is missing where its kernel cannot run). Tests force "own" or "onednn" to
    run a kernel the machine would not pick."""
    choice = _kernel_setting()
    reason = own_kernel_unavailable_reason()  # builds and loads it on the first call
    plan = forced_plan()
    if plan is not None:
        if "own" in plan.libraries() and reason is not None:
            raise RuntimeError(f"{KERNEL_ENV} names cpu_gemm.cpp, which cannot run here: {reason}")
        if "fma" in plan.libraries() and (fma_reason := fma_kernel_unavailable_reason()):
            raise RuntimeError(
                f"{KERNEL_ENV} names cpu_gemm_fma.cpp, which cannot run here: {fma_reason}"
            )
        return tuple(lib for lib in ("own", "fma", "onednn", "aten") if lib in plan.libraries())
    if choice == "own":
        if reason is not None:
            raise RuntimeError(f"{KERNEL_ENV}=own, but cpu_gemm.cpp cannot run here: {reason}")
        return ("own",)
    if choice == "fma":
        if (fma_reason := fma_kernel_unavailable_reason()) is not None:
            raise RuntimeError(
                f"{KERNEL_ENV}=fma, but cpu_gemm_fma.cpp cannot run here: {fma_reason}"
            )
        return ("fma",)
    if choice == "onednn":
        if not onednn_bf16_supported():
            raise RuntimeError(f"{KERNEL_ENV}=onednn, but oneDNN has no bf16 kernel here")
        return ("onednn",)
    if choice == "aten":
        return ("aten",)
    available: list[Library] = ["own"] if reason is None else []
    if fma_kernel_unavailable_reason() is None:
        available.append("fma")
    if onednn_bf16_supported():
        available.append("onednn")
    return (*available, "aten")


def default_plan() -> KernelPlan:
    """The plan of a PackedLinear built without one (outside a model: tests, tools): one
    kernel for every row count, the first allowed of cpu_gemm.cpp, cpu_gemm_fma.cpp,
    oneDNN, ATen. A model's own plan is measured (kernel_choice.py)."""
    library = allowed_libraries()[0]
    return forced_plan() or KernelPlan.single(KERNELS_BY_NAME[library])
