"""Fixtures shared by the bf16 CPU kernels' tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from plugserve_plugins.cpu_bf16 import cpu_features, kernel_setting
from tests.kernel_support import require_kernel


@pytest.fixture
def own_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 linears on cpu_gemm.cpp (PLUGSERVE_CPU_BF16_KERNEL=own) wherever this CPU can
    run it, whatever the production choice here (oneDNN on AMX CPUs); skipped, naming what
    is missing, where the CPU lacks its instructions; failed where it has them and the
    library still does not build or load."""
    reason = cpu_features.own_kernel_unavailable_reason()  # builds and loads the library
    require_kernel("cpu_gemm.cpp", cpu_features.OWN_KERNEL_CPU_FLAGS, reason)
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, "own")


@pytest.fixture
def onednn_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 linears on oneDNN (PLUGSERVE_CPU_BF16_KERNEL=onednn), as on CPUs without
    AVX512_BF16 or with AMX; skipped where oneDNN has no bf16 matmuls."""
    if not cpu_features.onednn_bf16_supported():
        pytest.skip("oneDNN has no bf16 matmuls on this CPU")
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, "onednn")


@pytest.fixture
def fma_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 linears on cpu_gemm_fma.cpp (PLUGSERVE_CPU_BF16_KERNEL=fma), the machine's
    own kernel on CPUs with AVX2 and no AVX512_BF16; skipped, naming what is missing, where
    the CPU lacks its instructions; failed where it has them and the library does not
    build or load."""
    reason = cpu_features.fma_kernel_unavailable_reason()
    require_kernel("cpu_gemm_fma.cpp", cpu_features.FMA_KERNEL_CPU_FLAGS, reason)
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, "fma")


@pytest.fixture
def row_pool(own_kernel: None) -> Iterator[None]:
    """The one-row matmuls on their helper thread (row_pool.h), as in an engine process,
    whatever this process's OpenMP spinning."""
    torch.ops.plugserve_ops.row_pool_set_enabled(True)
    yield
    torch.ops.plugserve_ops.row_pool_set_enabled(cpu_features.openmp_spins_briefly())
