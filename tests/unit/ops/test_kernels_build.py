"""Every compiled kernel builds and loads wherever the CPU has the instructions it is
written in: a compile error in one of them fails here instead of turning the tests that
use it into skips."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from plugserve.worker import cpu_ops
from plugserve_plugins.cpu_bf16 import cpu_features
from plugserve_plugins.kernels import cpu_paged_attention, cpu_prefill_attention
from plugserve_plugins.linear_methods import cpu_fp32, int8_w8a8, int8_weight_only, w8a8_plan
from tests.kernel_support import require_kernel


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    flags: Sequence[str]  # what the CPU needs for the kernel to exist
    unavailable_reason: Callable[[], str | None]


KERNELS = (
    CompiledKernel(
        "cpu_gemm.cpp",
        cpu_features.OWN_KERNEL_CPU_FLAGS,
        cpu_features.own_kernel_unavailable_reason,
    ),
    CompiledKernel(
        "cpu_decoder.cpp",
        cpu_features.OWN_KERNEL_CPU_FLAGS,
        cpu_features.decoder_unavailable_reason,
    ),
    CompiledKernel(
        "cpu_encoder.cpp",
        cpu_features.OWN_KERNEL_CPU_FLAGS,
        cpu_features.encoder_unavailable_reason,
    ),
    CompiledKernel(
        "cpu_gemm_fma.cpp",
        cpu_features.FMA_KERNEL_CPU_FLAGS,
        cpu_features.fma_kernel_unavailable_reason,
    ),
    CompiledKernel("cpu_ops.cpp", (), cpu_ops.unavailable_reason),
    CompiledKernel("cpu_paged_attention.cpp", (), cpu_paged_attention.unavailable_reason),
    CompiledKernel(
        "cpu_prefill_attention.cpp",
        cpu_prefill_attention.REQUIRED_CPU_FLAGS,
        cpu_prefill_attention.unavailable_reason,
    ),
    *(
        CompiledKernel(build.source.name, build.required_cpu_flags, build.unavailable_reason)
        for build in cpu_prefill_attention.FP32_VARLEN_KERNELS
    ),
    CompiledKernel(
        "cpu_fp32_gemm.cpp", cpu_fp32.FMA_REQUIRED_CPU_FLAGS, cpu_fp32.fma_unavailable_reason
    ),
    CompiledKernel(
        "int8_weight_only.cpp",
        int8_weight_only.REQUIRED_CPU_FLAGS,
        int8_weight_only.Int8WeightOnly.unavailable_reason,
    ),
    CompiledKernel(
        "int8_w8a8.cpp",
        w8a8_plan.REQUIRED_CPU_FLAGS,
        int8_w8a8.Int8W8A8.unavailable_reason,
    ),
)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda kernel: kernel.name)
def test_each_kernel_builds_and_loads_where_the_cpu_has_its_instructions(
    kernel: CompiledKernel,
) -> None:
    require_kernel(kernel.name, kernel.flags, kernel.unavailable_reason())
