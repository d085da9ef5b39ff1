"""Loads the C++ prefill-attention kernels: cpu_prefill_attention.cpp (bf16, causal and
varlen bidirectional) and, for fp32 varlen bidirectional, cpu_varlen_attention_f32.cpp
(AVX-512F) or, on a CPU without AVX-512F, cpu_varlen_attention_f32_avx2.cpp (AVX2).

A long prefill row (SDPA_MIN_QUERY_TOKENS or more) used to run torch's SDPA, whose CPU
flash kernel runs causal attention far below the dot-product peak of a CPU without AMX
(docs/benchmarks-history.md, "Figures from code comments"). This kernel does both
products on avx512_bf16's dot-product instruction, reading each KV head's keys and values
once per call in the layout it wants, with the GQA group's heads sharing them. Whether it
beats SDPA on a given CPU is measured, not assumed: `faster_than_sdpa` times both on the
model's head shapes once, and the backend keeps the faster.

An encoder's step is many short whole prompts, which SDPA takes one call each; the varlen
entries attend them all in one call per layer, in bf16 on the same dot-product
instruction, in fp32 on AVX-512F's or AVX2's FMA (`varlen_faster_than_sdpa` times them the
same way).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from plugserve import ops
from plugserve.ops.kernel_timing import median_ms_in_turns

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
# The head sizes the kernels' register tiles are written for.
HEAD_DIMS = (32, 64, 128)
# The instructions the kernels are written in (-march=native builds them where the CPU has
# them).
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
# The dtypes the varlen (bidirectional) entry takes.
VARLEN_DTYPES = (torch.bfloat16, torch.float32)


def load() -> bool:
    """Make torch.ops.plugserve_prefill.attention available; False where the CPU lacks
    AVX-512 BF16 or the kernel cannot be built or loaded (the reason logged once)."""
    flags = set(ops.cpu_flags().split())
    if not set(REQUIRED_CPU_FLAGS) <= flags:
        return False
    return ops.load(_SOURCE)


def unavailable_reason() -> str | None:
    """None where the kernel is built and loaded (load()), else why it is not: the CPU's
    missing flags, or the build's or loader's error."""
    return _unavailable_reason(_SOURCE, REQUIRED_CPU_FLAGS)


@dataclass(frozen=True)
class Fp32VarlenKernel:
    """One build of the fp32 varlen kernel: its source, the instructions it is written in
    (-march=native builds them where the CPU has them) and its torch.ops namespace."""

    source: Path
    required_cpu_flags: tuple[str, ...]
    namespace: str

    def unavailable_reason(self) -> str | None:
        """None once built and loaded here, else why not (missing flags, a failed build)."""
        return _unavailable_reason(self.source, self.required_cpu_flags)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: list[int],
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """varlen_bidirectional_attention in fp32 through this build (loaded first)."""
        ops_namespace = getattr(torch.ops, self.namespace)
        return ops_namespace.varlen_bidirectional(q, k, v, cu_seqlens, scale, softcap or 0.0)


# The fp32 builds, the preferred first: AVX-512F's 16 lanes, else AVX2's 8.
FP32_VARLEN_KERNELS = (
    Fp32VarlenKernel(
        Path(__file__).with_name("cpu_varlen_attention_f32.cpp"),
        ("avx512f",),
        "plugserve_varlen_f32",
    ),
    Fp32VarlenKernel(
        Path(__file__).with_name("cpu_varlen_attention_f32_avx2.cpp"),
        ("avx2", "fma"),
        "plugserve_varlen_f32_avx2",
    ),
)


def fp32_kernel() -> Fp32VarlenKernel:
    """The fp32 varlen build for this CPU: the first of FP32_VARLEN_KERNELS whose
    instructions it has (the last where it has none, which then says what is missing)."""
    flags = set(ops.cpu_flags().split())
    return next(
        (k for k in FP32_VARLEN_KERNELS if set(k.required_cpu_flags) <= flags),
        FP32_VARLEN_KERNELS[-1],
    )


def load_fp32() -> bool:
    """Make fp32 varlen_bidirectional_attention available; False where the CPU has neither
    AVX-512F nor AVX2 and FMA, or the kernel cannot be built or loaded (the reason logged
    once)."""
    return fp32_unavailable_reason() is None


def fp32_unavailable_reason() -> str | None:
    """None where the fp32 varlen kernel is built and loaded (load_fp32()), else why not."""
    return fp32_kernel().unavailable_reason()


def load_varlen(dtype: torch.dtype) -> bool:
    """Whether `varlen_bidirectional_attention` runs here in `dtype` (loading its kernel)."""
    if dtype == torch.bfloat16:
        return load()
    return dtype == torch.float32 and load_fp32()


def _unavailable_reason(source: Path, flags: tuple[str, ...]) -> str | None:
    missing = [flag for flag in flags if flag not in ops.cpu_flags().split()]
    if missing:
        return f"the CPU lacks {' and '.join(missing)}"
    return ops.unavailable_reason(source)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [Tq, H, D] over k/v [Tk, KVH, D] (bf16): query i sits at
    position Tk - Tq + i and sees the keys up to its own, only the last `window` of them
    when window is set; scores are scaled, then soft-capped when softcap is set."""
    return torch.ops.plugserve_prefill.attention(q, k, v, scale, softcap or 0.0, window or 0)


def varlen_bidirectional_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: list[int],
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Whole prompts attending within themselves (an encoder's layer), in one call: the
    tokens [cu_seqlens[b], cu_seqlens[b + 1]) of q [T, H, D] and k/v [T, KVH, D] (bf16 or
    fp32, whose kernel load_varlen loaded) are prompt b's, and each of its queries attends
    to all of its keys."""
    if q.dtype == torch.float32:
        return fp32_kernel().attend(q, k, v, cu_seqlens, scale, softcap)
    return torch.ops.plugserve_prefill.varlen_bidirectional(
        q, k, v, cu_seqlens, scale, softcap or 0.0
    )


def _kernel_is_faster(kernel: Callable[[], None], sdpa: Callable[[], None]) -> tuple[bool, str]:
    """Whether `kernel` ran faster than `sdpa` (medians of runs taken in turns, so that a
    noisy neighbour slows both alike), and the timings for the log."""
    runs = {"kernel": kernel, "SDPA": sdpa}
    medians = median_ms_in_turns(list(runs), lambda name: runs[name](), rounds=7)
    faster = medians["kernel"] < medians["SDPA"]
    return faster, (
        f"kernel {medians['kernel']:.2f} ms, SDPA {medians['SDPA']:.2f} ms; using "
        f"{'the kernel' if faster else 'SDPA'}"
    )


def faster_than_sdpa(num_heads: int, num_kv_heads: int, head_dim: int, tokens: int = 512) -> bool:
    """Times the kernel and SDPA (fresh causal prefill, bf16, median of a few runs) on
    these head shapes and says whether the kernel was faster; logs both timings."""
    generator = torch.Generator().manual_seed(0)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(tokens, heads, head_dim, generator=generator).to(torch.bfloat16)

    q, k, v = rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)
    scale = head_dim**-0.5

    def sdpa() -> None:
        F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )

    def kernel() -> None:
        prefill_attention(q, k, v, scale)

    faster, timings = _kernel_is_faster(kernel, sdpa)
    logger.info(
        "prefill attention at %d tokens (%d/%d heads, head_dim %d): %s",
        tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        timings,
    )
    return faster


# The prompts an encoder's timing attends: mixed short lengths, as embedding requests are.
ENCODER_TIMING_LENGTHS = (9, 17, 30, 48, 64, 80, 100, 127) * 2


def varlen_faster_than_sdpa(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16
) -> bool:
    """Times the varlen kernel (one call for a batch of whole prompts) against SDPA (one
    unmasked call per prompt, as the torch backend runs an encoder's layer without it) on
    these head shapes in `dtype` (load_varlen(dtype) first), and says whether the kernel
    was faster; logs both timings."""
    generator = torch.Generator().manual_seed(0)
    cu_seqlens = [0]
    for length in ENCODER_TIMING_LENGTHS:
        cu_seqlens.append(cu_seqlens[-1] + length)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(cu_seqlens[-1], heads, head_dim, generator=generator).to(dtype)

    q, k, v = rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)
    scale = head_dim**-0.5

    def sdpa() -> None:
        for start, end in itertools.pairwise(cu_seqlens):
            F.scaled_dot_product_attention(
                *(t[start:end].transpose(0, 1)[None] for t in (q, k, v)),
                scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )

    def kernel() -> None:
        varlen_bidirectional_attention(q, k, v, cu_seqlens, scale)

    faster, timings = _kernel_is_faster(kernel, sdpa)
    logger.info(
        "bidirectional attention in %s over %d prompts (%d/%d heads, head_dim %d): %s",
        str(dtype).removeprefix("torch."),
        len(ENCODER_TIMING_LENGTHS),
        num_heads,
        num_kv_heads,
        head_dim,
        timings,
    )
    return faster
