"""What this machine offers the bf16 CPU kernels: whether cpu_gemm.cpp (and the fused
decoder's cpu_decoder.cpp and the fused encoder's cpu_encoder.cpp, built on it) build and
run here, cpu_gemm_fma.cpp (fp32 FMA tiles, AVX2's or AVX-512F's), oneDNN's bf16 matmuls, AMX
tiles, and whether OpenMP lets the one-row matmuls share their work with the row pool's
helper thread.

cpu_gemm.cpp, cpu_gemm_fma.cpp, cpu_decoder.cpp and cpu_encoder.cpp are this package's C++
(beside this file), compiled once per machine by plugserve.ops' build helper against its
public headers (cpu_bf16.h, cpu_vec_math.h, cpu_ops.h, row_pool.h, layer_attention.h,
cpu_fma_tiles.h).
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import torch

from plugserve import ops

_HERE = Path(__file__).parent
GEMM_SOURCE = _HERE / "cpu_gemm.cpp"
DECODER_SOURCE = _HERE / "cpu_decoder.cpp"
ENCODER_SOURCE = _HERE / "cpu_encoder.cpp"
FMA_GEMM_SOURCE = _HERE / "cpu_gemm_fma.cpp"

# What cpu_gemm.cpp's kernel needs of the CPU (cpu_gemm.h: PLUGSERVE_HAS_BF16_GEMM).
OWN_KERNEL_CPU_FLAGS = ("avx512f", "avx512_bf16")
# What cpu_gemm_fma.cpp's kernel needs (cpu_fma_tiles.h: PLUGSERVE_HAS_FMA_TILES).
FMA_KERNEL_CPU_FLAGS = ("avx2", "fma")


def fma_kernel_unavailable_reason() -> str | None:
    """None where this machine can run cpu_gemm_fma.cpp (built and loaded on the first
    call), else what is missing: the CPU's flags, or the build's or loader's error."""
    flags = ops.cpu_flags().split()
    missing = [flag for flag in FMA_KERNEL_CPU_FLAGS if flag not in flags]
    if missing:
        return f"the CPU lacks {' and '.join(missing)}"
    error = ops.unavailable_reason(FMA_GEMM_SOURCE)
    if error is not None:
        return f"cpu_gemm_fma.cpp cannot be built or loaded: {error}"
    return None


def own_kernel_unavailable_reason() -> str | None:
    """None where this machine can run cpu_gemm.cpp, whether or not a plan picks it
    here; else what is missing: "the CPU lacks avx512_bf16" (or avx512f), or
    "cpu_gemm.cpp cannot be built or loaded: ..." with the compiler's or loader's error.
    On the first call where the CPU has what it needs, builds and loads the library, and
    turns the row pool on where openmp_spins_briefly."""
    flags = ops.cpu_flags().split()
    missing = [flag for flag in OWN_KERNEL_CPU_FLAGS if flag not in flags]
    if missing:
        return f"the CPU lacks {' and '.join(missing)}"
    return _load_own_kernel()


@cache
def _load_own_kernel() -> str | None:
    """Builds and loads cpu_gemm.cpp; None where its kernel is then there, else why not."""
    # The row pool the one-row matmuls share their work through is core's cpu_ops.cpp's
    # (row_pool.h): loaded first, so that cpu_gemm.cpp finds it.
    pool = ops.load(ops.OPS_SOURCE) and hasattr(torch.ops.plugserve_ops, "row_pool_set_enabled")
    error = ops.unavailable_reason(GEMM_SOURCE)
    if error is not None:
        return f"cpu_gemm.cpp cannot be built or loaded: {error}"
    if not hasattr(torch.ops.plugserve_gemm, "linear_bf16"):
        return (
            "cpu_gemm.cpp was built without its kernel "
            "(the compiler's -march=native does not enable AVX512_BF16)"
        )
    if pool and openmp_spins_briefly():
        torch.ops.plugserve_ops.row_pool_set_enabled(True)
    return None


def decoder_unavailable_reason() -> str | None:
    """None where cpu_decoder.cpp (the layer stack as one op) builds and loads here (it
    needs cpu_gemm.cpp's kernel), else why not."""
    return _built_on_gemm_reason(DECODER_SOURCE, "plugserve_decoder", "decode_layers")


def encoder_unavailable_reason() -> str | None:
    """None where cpu_encoder.cpp (an encoder layer's stretch as one op) builds and loads
    here (it needs cpu_gemm.cpp's kernel), else why not."""
    return _built_on_gemm_reason(ENCODER_SOURCE, "plugserve_encoder", "encode_stretch")


def _built_on_gemm_reason(source: Path, namespace: str, op: str) -> str | None:
    """None where `source`, a library over cpu_gemm.h, runs here (built and loaded, with
    torch.ops.<namespace>.<op>), else why not."""
    reason = own_kernel_unavailable_reason()
    if reason is not None:
        return reason
    error = ops.unavailable_reason(source)
    if error is not None:
        return f"{source.name} cannot be built or loaded: {error}"
    if not hasattr(getattr(torch.ops, namespace), op):
        return f"{source.name} was built without its ops"
    return None


def fused_layers_unsupported_reason(weight: torch.Tensor) -> str | None:
    """Why a model whose norm has this `weight` cannot run fused layers (None where it
    can): they run bf16 on a CPU, over core's fused CPU ops."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        dtype = str(weight.dtype).removeprefix("torch.")
        return f"the fused layers run bf16 on a CPU, the model {dtype} on {weight.device.type}"
    reason = ops.unavailable_reason(ops.OPS_SOURCE)
    if reason is not None:
        return f"core's fused CPU ops (cpu_ops.cpp) are unavailable: {reason}"
    return None


def onednn_bf16_supported() -> bool:
    """Whether torch's oneDNN has bf16 matmuls on this CPU."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def amx_available() -> bool:
    """Whether cpu_gemm.cpp runs AMX tiles here (built for AMX-BF16, allowed by the OS)."""
    return own_kernel_unavailable_reason() is None and bool(
        torch.ops.plugserve_gemm.amx_available()
    )


def row_pool_enabled() -> bool:
    """Whether one-row matmuls share their work with the row pool's helper thread (which
    also needs more than one torch thread to be used)."""
    return bool(
        ops.load(ops.OPS_SOURCE)
        and hasattr(torch.ops.plugserve_ops, "row_pool_enabled")
        and torch.ops.plugserve_ops.row_pool_enabled()
    )


# At most this many turns of spinning after a parallel region (GNU OpenMP's default is
# 300000) for the one-row matmuls to use their helper thread.
_BRIEF_SPIN_COUNT = 20000
# How long a release of the row pool's inputs waits for its helper to go idle (microseconds).
_HELPER_IDLE_WAIT_US = 50_000


def release_row_pool_inputs() -> None:
    """Let the row pool's job slots drop the tensors the last one-row jobs ran over: the
    kernel choice's measured copies of the weights would otherwise stay mapped until later
    one-row jobs replaced them (docs/benchmarks.md, "Memory by kernel plan")."""
    if ops.load(ops.OPS_SOURCE) and hasattr(torch.ops.plugserve_ops, "row_pool_release_inputs"):
        torch.ops.plugserve_ops.row_pool_release_inputs(_HELPER_IDLE_WAIT_US)


def openmp_spins_briefly() -> bool:
    """Whether this process started with OpenMP's threads spinning only briefly after a
    parallel region (GOMP_SPINCOUNT, read when OpenMP loads): engine processes do
    (plugserve.ops.process_env). Only then do one-row matmuls share their blocks with the
    helper thread of row_pool.h: a spinning OpenMP thread would starve it."""
    try:
        return int(os.environ.get("GOMP_SPINCOUNT", "")) <= _BRIEF_SPIN_COUNT
    except ValueError:
        return False
