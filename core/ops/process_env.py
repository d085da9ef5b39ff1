"""The environment an engine process starts with, for the compiled ops' sake.

Whoever starts engine processes (an API server, the launcher) asks here rather than
knowing kernel settings itself: a child started from a fresh interpreter reads its
environment at start, and OpenMP reads GOMP_SPINCOUNT once, when it loads. Torch-free,
so the starting side can import it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys

# After each parallel region GNU OpenMP's threads spin 300000 turns before they sleep: at a
# batch-1 decode step that kept a second core busy through the step's Python, where the
# one-row matmuls' helper thread (row_pool.h) and the API server could have run. 2000
# turns still cover the gaps between the regions of a batched step.
#
# glibc's malloc returns a large freed block to the kernel at once (mmap'd past a threshold
# it raises only as far as the largest block freed so far; the heap's top trimmed past a
# small size), so each prefill's [tokens, intermediate] activations came back as fresh
# pages that every step faulted in and zeroed again. Blocks up to 32 MB (the most glibc
# allows here) now come from the heap, and up to 1 GB of free heap stays mapped (figures:
# docs/benchmarks-history.md, "bf16 CPU kernels by row count"). Both variables are read
# when the process starts.
ENGINE_ENVIRONMENT = {
    "GOMP_SPINCOUNT": "2000",
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**30),
}


def engine_environment() -> dict[str, str]:
    """Variables an engine process should start with, where the user has not set them."""
    return dict(ENGINE_ENVIRONMENT)


def adopt_engine_environment() -> None:
    """Set the engine environment in this process, where the user has not: for a process
    that forks its engines (plugserve serve), before it loads torch and with it OpenMP.
    malloc has read its variables already; a forked engine applies them itself
    (apply_malloc_environment)."""
    for name, value in engine_environment().items():
        os.environ.setdefault(name, value)


# glibc's mallopt parameters that the MALLOC_*_ variables set at a process's start.
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3}


def release_free_heap() -> None:
    """Hand the kernel back the heap this process holds free: once, when an engine has
    loaded and processed its weights (after collecting what cycles loading left). Loading
    frees its transient copies (a layer's float copy while it is quantized, the loaded
    weight once packed) into a heap that the engine's trim threshold then keeps mapped, as
    it must for its steps' activations: resident memory holding nothing
    (docs/benchmarks.md, "Memory by kernel plan")."""
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def apply_malloc_environment() -> None:
    """What glibc's malloc would have read from the environment at this process's start,
    applied now: for a process forked from one that started without it."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        for name, parameter in _MALLOPT.items():
            value = os.environ.get(name)
            if value is not None and value.isdigit():
                libc.mallopt(parameter, int(value))
