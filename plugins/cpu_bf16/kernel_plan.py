"""Which kernel runs a bf16 CPU matmul of a given number of rows: the plan's vocabulary.

No kernel wins everywhere: which one is fastest depends on the CPU (AMX tiles or not, its
caches) and on the number of rows, a weight stream winning one-row steps where tile
kernels win batches (measurements: docs/benchmarks-history.md, "bf16 CPU kernels by row
count"). So a model's matmuls are dispatched by their row count, in buckets
(ROW_BUCKETS, plugserve.ops.kernel_timing's), to the kernel that measured fastest for that
bucket on this machine (kernel_choice.py): a KernelPlan.

Torch-free apart from the annotations, so that a plan can be read, printed and cached
anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plugserve.ops.kernel_timing import ONE_ROW, RowBucket, bucket_index, is_prefill, row_buckets

Library = Literal["own", "fma", "onednn", "aten"]


# The measured row counts: each prefill bucket from there on, a new row count each run
# (kernel_choice.run_rows). oneDNN's fused MLP pays off on long prefill chunks and not on
# short ones (docs/benchmarks-history.md, "bf16 CPU kernels by row count").
ROW_BUCKETS: tuple[RowBucket, ...] = row_buckets((1, 8, 32, 128, 1024))


# cpu_gemm.h's OneRowMode: how cpu_gemm.cpp runs a single row, or AMX: every row count on
# AMX tiles (cpu_gemm_amx.h), over the same packed weights.
STREAM_NON_TEMPORAL, STREAM_CACHED, TILED, AMX = 0, 1, 2, 3


@dataclass(frozen=True)
class Kernel:
    """One way to run a bf16 matmul on the CPU.

    library: "own" (cpu_gemm.cpp over k-pair-packed weights; needs AVX512_BF16), "fma"
    (cpu_gemm_fma.cpp over panels of two vectors' columns, widened to fp32 in registers:
    fp32 FMA tiles, AVX-512F's or AVX2's; the machine's own kernel where AVX512_BF16 is
    missing, and the faster one where the fp32 FMA outruns VDPBF16PS), "onednn"
    (torch's oneDNN over its own blocked layout: AMX tiles where the CPU has them), "aten"
    (F.linear over the weight as loaded). For "own", one_row_mode and coded say how a
    single row runs (a stream over the plain or the exponent-coded copy, or the tile
    kernel), or one_row_mode AMX runs every row count on AMX tiles; for "onednn",
    fused_mlp runs a gated MLP as three matmuls with SiLU and the product as post-ops.
    """

    name: str
    library: Library
    one_row_mode: int = STREAM_NON_TEMPORAL
    coded: bool = False
    fused_mlp: bool = False


OWN = Kernel("own", "own")
OWN_CACHED = Kernel("own/cached", "own", one_row_mode=STREAM_CACHED)
OWN_TILED = Kernel("own/tiled", "own", one_row_mode=TILED)
OWN_CODED = Kernel("own/coded", "own", coded=True)
OWN_CODED_CACHED = Kernel("own/coded/cached", "own", one_row_mode=STREAM_CACHED, coded=True)
OWN_AMX = Kernel("own/amx", "own", one_row_mode=AMX)
ONEDNN = Kernel("onednn", "onednn")
ONEDNN_FUSED_MLP = Kernel("onednn/fused-mlp", "onednn", fused_mlp=True)
FMA_TILES = Kernel("fma", "fma")
ATEN = Kernel("aten", "aten")
KERNELS: tuple[Kernel, ...] = (
    OWN,
    OWN_CACHED,
    OWN_TILED,
    OWN_CODED,
    OWN_CODED_CACHED,
    OWN_AMX,
    FMA_TILES,
    ONEDNN,
    ONEDNN_FUSED_MLP,
    ATEN,
)
KERNELS_BY_NAME = {kernel.name: kernel for kernel in KERNELS}

# The kernels whose every output row is the same bits whatever other rows share the call
# (engine.batch_invariant): cpu_gemm.cpp's tile loops sum each output over K in one order,
# one row at a time, and split only the outputs among threads, at every row count; the one
# row of TILED runs the same tile loop (the streaming one-row modes reduce otherwise, and
# oneDNN and ATen choose their algorithm, hence their order, by the row count). A plan of
# one of them for every bucket keeps a request's logits independent of its batch; mixing
# two would not (the vector and the tile instructions add a pair's products differently).
BATCH_INVARIANT_KERNELS: tuple[Kernel, ...] = (OWN_TILED, OWN_AMX)


# The copies of a weight a kernel reads: cpu_gemm's k-pair-packed one ("packed"), its
# exponent-coded copy beside it ("coded": a coded block may point back into the packed
# one), cpu_gemm_fma's panels ("panels"), oneDNN's blocked one ("onednn"; the
# fused MLP reads it for the down projection and blocked copies of its own of the gate and
# up halves, "fused_gate_up"), or the weight as
# loaded ("plain"). Each layout a plan uses is one more copy of (part of) the model's
# weights in memory; LAYOUT_SHARE is roughly what share of the weights' bytes it adds
# (a Llama-shaped MLP holds about two thirds of them, its gate and up two thirds of that).
Layout = Literal["packed", "coded", "panels", "onednn", "fused_gate_up", "plain"]
LAYOUT_SHARE: dict[str, float] = {
    "packed": 1.0,
    "coded": 0.75,
    "panels": 1.0,
    "onednn": 1.0,
    "fused_gate_up": 0.45,
    "plain": 1.0,
}


def layouts_of(kernel: Kernel) -> frozenset[str]:
    """The copies of a weight `kernel` reads (Layout)."""
    if kernel.library == "own":
        return frozenset({"packed", "coded"} if kernel.coded else {"packed"})
    if kernel.library == "fma":
        return frozenset({"panels"})
    if kernel.library == "onednn":
        return frozenset({"onednn", "fused_gate_up"} if kernel.fused_mlp else {"onednn"})
    return frozenset({"plain"})


def candidates_for(
    bucket: int, libraries: tuple[Library, ...], coded: bool, amx: bool = False
) -> list[Kernel]:
    """The kernels worth timing for a bucket: the one-row variants only at one row (they
    run more rows alike), coded ones only where coded copies are allowed, AMX tiles where
    the CPU and cpu_gemm.cpp's build have them, the fused MLP only for prefill chunks
    (smaller steps keep one gate-up matmul)."""
    kernels = []
    for kernel in KERNELS:
        if kernel.library not in libraries or (kernel.coded and not coded):
            continue
        if kernel.one_row_mode == AMX and not amx:
            continue
        one_row_only = kernel.one_row_mode in (STREAM_CACHED, TILED) or kernel.coded
        if bucket != ONE_ROW and one_row_only:
            continue
        if kernel.fused_mlp and not is_prefill(bucket):
            continue
        kernels.append(kernel)
    return kernels


@dataclass(frozen=True)
class KernelPlan:
    """The kernel for each ROW_BUCKETS bucket."""

    by_bucket: tuple[Kernel, ...]

    @classmethod
    def single(cls, kernel: Kernel) -> KernelPlan:
        return cls((kernel,) * len(ROW_BUCKETS))

    def for_rows(self, rows: int) -> Kernel:
        return self.by_bucket[bucket_index(rows)]

    def libraries(self) -> set[Library]:
        return {kernel.library for kernel in self.by_bucket}

    def layouts(self) -> frozenset[str]:
        """The copies of each weight this plan keeps (Layout)."""
        return frozenset().union(*(layouts_of(kernel) for kernel in self.by_bucket))

    @property
    def one_row_mode(self) -> int:
        return self.by_bucket[ONE_ROW].one_row_mode

    @property
    def coded(self) -> bool:
        """Whether one-row matmuls read exponent-coded copies (which must then exist)."""
        return self.by_bucket[ONE_ROW].coded

    @property
    def fused_mlp(self) -> bool:
        """Whether some bucket runs its gated MLPs as oneDNN post-ops."""
        return any(kernel.fused_mlp for kernel in self.by_bucket)

    def describe(self) -> str:
        return ", ".join(
            f"{bucket.name} rows: {kernel.name}"
            for bucket, kernel in zip(ROW_BUCKETS, self.by_bucket, strict=True)
        )
