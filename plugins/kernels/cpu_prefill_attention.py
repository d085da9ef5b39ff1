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

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from plugserve import ops

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
# The head sizes the kernel's register tiles are written for.
HEAD_DIMS = (64, 128)
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

    def median_ms(run: Callable[[], None], repeats: int = 7) -> float:
        run()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e3

    # Interleaved, so that a noisy neighbour slows both alike.
    kernel_ms, sdpa_ms = median_ms(kernel), median_ms(sdpa)
    kernel_ms = min(kernel_ms, median_ms(kernel))
    faster = kernel_ms < sdpa_ms
    logger.info(
        "prefill attention at %d tokens (%d/%d heads, head_dim %d): kernel %.2f ms, "
        "SDPA %.2f ms; using %s",
        tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        kernel_ms,
        sdpa_ms,
        "the kernel" if faster else "SDPA",
    )
    return faster
