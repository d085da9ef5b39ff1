"""Which kernel runs a W8A8 matmul of a given number of rows, chosen by timing the
candidates on the model's own weights (the bf16 CPU method's pattern, for int8).

The candidates compute the same int32 sums, each exact, and dequantize them alike, so
they give the same bits and the choice changes only the speed:

- `vnni`: int8_w8a8.cpp's AVX512-VNNI kernel (a weight stream at one row, register tiles
  of up to 8 rows); `vnni/tiled`: one row through the register tiles too;
- `amx`: int8_w8a8.cpp's AMX-INT8 tiles, where the CPU and the build have them;
- `int_mm`: torch._int_mm (ATen's s8 x s8 matmul on CPU) over the weight as quantized,
  the activation codes shifted to int8 and the shift compensated like the zero point.

One row chooses between `vnni` and `vnni/tiled` (the other two compute 16 rows to use
one). The other buckets are timed on the leading layers of the model as the bf16 method
times its kernels (plugserve.ops.kernel_timing), and the plan kept per machine and model
shape under the plugserve cache dir; PLUGSERVE_REMEASURE_KERNELS=1 measures again. Unlike the bf16 method's plan,
it is kept even where other processes were busy while it was timed: a plan only changes
the speed here, never the results.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from plugserve import ops
from plugserve.capabilities import REMEASURE_KERNELS_ENV
from plugserve.ops.build import cache_key as source_key
from plugserve.ops.kernel_timing import (
    RowBucket,
    bucket_index,
    cpu_model_name,
    is_prefill,
    leading,
    median_ms_in_turns,
    plan_digest,
    row_buckets,
    shapes_digest,
)
from plugserve.user_cache import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_w8a8.cpp")
# The kernel's instructions (-march=native builds them; a CPU without them cannot run it).
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
VNNI, VNNI_TILED, AMX, INT_MM = "vnni", "vnni/tiled", "amx", "int_mm"
KERNEL_IDS = {VNNI: 0, AMX: 1, INT_MM: 2, VNNI_TILED: 3}  # int8_w8a8.cpp's `kernel` argument


ROW_BUCKETS: tuple[RowBucket, ...] = row_buckets((1, 8, 32, 128, 512))
ROUNDS = 5
# Timed on at most this many bytes of int8 weights (the model's leading matmuls): enough
# that a few rows stream them from memory as a step does; prefill chunks are bound by the
# arithmetic, not the weights, and a layer's worth times them.
MEASURED_BYTES = 32 * 2**20
PREFILL_MEASURED_BYTES = 4 * 2**20
_PLAN_FORMAT = 1


@dataclass(frozen=True)
class W8A8Plan:
    """The kernel of each ROW_BUCKETS bucket, and, where measured, each candidate's median
    milliseconds for the measured matmuls per bucket."""

    by_bucket: tuple[str, ...]
    times_ms: tuple[dict[str, float], ...] = ()
    from_cache: bool = False

    def for_rows(self, rows: int) -> str:
        return self.by_bucket[bucket_index(rows)]

    def uses(self, kernel: str) -> bool:
        return kernel in self.by_bucket

    def describe(self) -> str:
        return ", ".join(
            f"{bucket.name} rows: {kernel}"
            for bucket, kernel in zip(ROW_BUCKETS, self.by_bucket, strict=True)
        )

    def table(self) -> str:
        """A markdown table of the times: buckets down, candidates across, * chosen."""
        names = [k for k in (VNNI, VNNI_TILED, AMX, INT_MM) if any(k in t for t in self.times_ms)]
        lines = ["| rows | chosen | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for bucket, chosen, times in zip(ROW_BUCKETS, self.by_bucket, self.times_ms, strict=True):
            cells = [
                "—" if n not in times else f"{times[n]:.3f}" + ("*" if n == chosen else "")
                for n in names
            ]
            lines.append(f"| {bucket.name} | {chosen} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def amx_available() -> bool:
    """Whether int8_w8a8.cpp runs AMX-INT8 tiles here (built for them, allowed by Linux); a
    CPU without the kernel's own instructions has no build of it to ask."""
    if not set(REQUIRED_CPU_FLAGS) <= set(ops.cpu_flags().split()):
        return False
    return ops.load(SOURCE) and bool(torch.ops.plugserve_w8a8.amx_available())


@cache
def int_mm_available() -> bool:
    """Whether this torch computes torch._int_mm on CPU."""
    try:
        a = torch.ones(32, 64, dtype=torch.int8)
        return bool(torch._int_mm(a, a.t().contiguous()).eq(64).all())
    except (RuntimeError, NotImplementedError):
        return False


def candidates_here() -> list[list[str]]:
    """Per ROW_BUCKETS bucket, the kernels a plan may give it on this machine."""
    more = [VNNI]
    if amx_available():
        more.append(AMX)
    if int_mm_available():
        more.append(INT_MM)
    return [[VNNI, VNNI_TILED]] + [list(more) for _ in ROW_BUCKETS[1:]]


Run = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MeasuredMatmul:
    """One matmul of a step to time: run(kernel, x) with x of `in_features` columns."""

    run: Run
    in_features: int
    out_features: int

    @property
    def weight_bytes(self) -> int:
        return self.in_features * self.out_features


def plan_for(matmuls: Sequence[MeasuredMatmul], remeasure: bool | None = None) -> W8A8Plan:
    """The plan for a model whose step runs `matmuls`: cached for this machine and shape,
    else timed now and cached."""
    candidates = candidates_here()
    if all(len(c) == 1 for c in candidates):
        return W8A8Plan(tuple(c[0] for c in candidates))
    key = _cache_key(matmuls, candidates)
    path = cache_root() / "w8a8_plans" / f"{plan_digest(key)}.json"
    if remeasure is None:
        remeasure = os.environ.get(REMEASURE_KERNELS_ENV, "") not in ("", "0")
    if not remeasure and path.exists():
        try:
            data = json.loads(path.read_text())
            return W8A8Plan(tuple(data["plan"]), tuple(data["times_ms"]), from_cache=True)
        except (KeyError, ValueError, TypeError) as exc:
            logger.warning("ignoring unreadable W8A8 plan %s: %s", path, exc)
    plan = measure(matmuls, candidates)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "plan": plan.by_bucket, "times_ms": plan.times_ms}))
    tmp.replace(path)  # atomic: engines starting together read a whole file
    return plan


def measure(
    matmuls: Sequence[MeasuredMatmul],
    candidates: list[list[str]],
    clock: Callable[[], float] = time.perf_counter,
) -> W8A8Plan:
    """Each bucket's fastest candidate over the leading `matmuls`, timed in turns
    (kernel_timing.median_ms_in_turns)."""
    chosen, times = [], []
    for index, (bucket, kernels) in enumerate(zip(ROW_BUCKETS, candidates, strict=True)):
        if len(kernels) == 1:
            chosen.append(kernels[0])
            times.append({})
            continue
        limit = PREFILL_MEASURED_BYTES if is_prefill(index) else MEASURED_BYTES
        timed = leading(matmuls, lambda m: m.weight_bytes, limit)
        inputs = {
            m.in_features: torch.randn(bucket.measured_rows, m.in_features).to(torch.bfloat16)
            for m in timed
        }
        medians = median_ms_in_turns(
            kernels,
            lambda kernel, timed=timed, inputs=inputs: _step(timed, kernel, inputs),
            ROUNDS,
            clock,
        )
        chosen.append(min(medians, key=medians.__getitem__))
        times.append(medians)
    return W8A8Plan(tuple(chosen), tuple(times))


def _step(matmuls: Sequence[MeasuredMatmul], kernel: str, inputs: dict[int, torch.Tensor]) -> None:
    for matmul in matmuls:
        matmul.run(kernel, inputs[matmul.in_features])


def _cache_key(matmuls: Sequence[MeasuredMatmul], candidates: list[list[str]]) -> dict[str, object]:
    shapes = [[m.out_features, m.in_features] for m in matmuls]
    return {
        "cpu": cpu_model_name(),
        "flags": ops.cpu_flags(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kernels": source_key(SOURCE),
        "candidates": candidates,
        "shapes": shapes_digest(shapes),
        "format": _PLAN_FORMAT,
    }
