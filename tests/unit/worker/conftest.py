"""Fixtures shared by the worker's kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from plugserve.worker import cpu_linear


@pytest.fixture
def row_pool() -> Iterator[None]:
    """The one-row matmuls on their helper thread (row_pool.h), as in an engine process,
    whatever this process's OpenMP spinning."""
    cpu_linear.uses_own_kernel()  # loads the library
    torch.ops.plugserve_gemm.row_pool_set_enabled(True)
    yield
    torch.ops.plugserve_gemm.row_pool_set_enabled(cpu_linear.openmp_spins_briefly())
