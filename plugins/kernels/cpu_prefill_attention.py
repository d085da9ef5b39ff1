"""Loads the C++ prefill-attention kernel (cpu_prefill_attention.cpp).

A long prefill row (SDPA_MIN_QUERY_TOKENS or more) used to run torch's SDPA, whose CPU
flash kernel runs causal attention far below the dot-product peak of a CPU without AMX
(docs/benchmarks-history.md, "Figures from code comments"). This kernel does both
products on avx512_bf16's dot-product instruction, reading each KV head's keys and values
once per call in the layout it wants, with the GQA group's heads sharing them. Whether it
beats SDPA on a given CPU is measured, not assumed: `faster_than_sdpa` times both on the
model's head shapes once, and the backend keeps the faster.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from plugserve import ops
from plugserve.ops.kernel_timing import median_ms_in_turns

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
# The head sizes the kernel's register tiles are written for.
HEAD_DIMS = (32, 64, 128)
# The instructions the kernel is written in (-march=native builds them where the CPU has them).
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")


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
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in ops.cpu_flags().split()]
    if missing:
        return f"the CPU lacks {' and '.join(missing)}"
    return ops.unavailable_reason(_SOURCE)


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
    tokens [cu_seqlens[b], cu_seqlens[b + 1]) of q [T, H, D] and k/v [T, KVH, D] (bf16)
    are prompt b's, and each of its queries attends to all of its keys."""
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


def varlen_faster_than_sdpa(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Times the varlen kernel (one call for a batch of whole prompts) against SDPA (one
    unmasked call per prompt, as the torch backend runs an encoder's layer without it) on
    these head shapes, bf16, and says whether the kernel was faster; logs both timings."""
    generator = torch.Generator().manual_seed(0)
    cu_seqlens = [0]
    for length in ENCODER_TIMING_LENGTHS:
        cu_seqlens.append(cu_seqlens[-1] + length)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(cu_seqlens[-1], heads, head_dim, generator=generator).to(torch.bfloat16)

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
        "bidirectional attention over %d prompts (%d/%d heads, head_dim %d): %s",
        len(ENCODER_TIMING_LENGTHS),
        num_heads,
        num_kv_heads,
        head_dim,
        timings,
    )
    return faster
