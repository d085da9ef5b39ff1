"""Kernels chosen by the row count of a matmul, by timing them on the model's own weights:
what a linear method's measured plan is built from.

No kernel wins at every row count (a weight stream wins one-row decode steps, tile kernels
win batches and prefills), so a plan gives each row bucket (row_buckets) the kernel that
timed fastest for it on this machine. The timing (median_ms_in_turns) runs every candidate
once a round, each round starting from another one, so that none always follows the same
one and a change in the machine's speed reaches all of them alike; the median of the
rounds counts. A plan is kept per machine and model shape (plan_key, plan_digest).
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

# The row counts the engine's steps produce: batch-1 decode, small and large decode
# batches, short and long prefill chunks (whose head runs on the few sampled rows, a
# decode bucket).
_BUCKET_BOUNDS: tuple[tuple[int, int | None], ...] = (
    (1, 1),
    (2, 8),
    (9, 64),
    (65, 256),
    (257, None),
)
ONE_ROW, FIRST_PREFILL = 0, 3


@dataclass(frozen=True)
class RowBucket:
    """Matmuls of first..last rows (last None: no bound), timed at `measured_rows`."""

    name: str
    first: int
    last: int | None
    measured_rows: int


def row_buckets(measured_rows: Sequence[int]) -> tuple[RowBucket, ...]:
    """The buckets, each timed at its entry of `measured_rows` (one per bucket)."""
    if len(measured_rows) != len(_BUCKET_BOUNDS):
        raise ValueError(f"{len(measured_rows)} row counts for {len(_BUCKET_BOUNDS)} buckets")
    return tuple(
        RowBucket(
            str(first) if first == last else f"{first}+" if last is None else f"{first}-{last}",
            first,
            last,
            rows,
        )
        for (first, last), rows in zip(_BUCKET_BOUNDS, measured_rows, strict=True)
    )


def bucket_index(rows: int) -> int:
    """The bucket of a matmul over `rows` rows."""
    return 0 if rows <= 1 else 1 if rows <= 8 else 2 if rows <= 64 else 3 if rows <= 256 else 4


def is_prefill(bucket: int) -> bool:
    return bucket >= FIRST_PREFILL


def median_ms_in_turns(
    kernels: Sequence[K],
    run: Callable[[K], object],
    rounds: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[K, float]:
    """Each kernel's median milliseconds of run(kernel) over `rounds` rounds, read off
    `clock` (seconds), after one untimed warm-up run each; every round runs each kernel
    once, starting from another one each round."""
    for kernel in kernels:
        run(kernel)
    samples: dict[K, list[float]] = {kernel: [] for kernel in kernels}
    for round_index in range(rounds):
        shift = round_index % len(kernels)
        for kernel in [*kernels[shift:], *kernels[:shift]]:
            start = clock()
            run(kernel)
            samples[kernel].append(1e3 * (clock() - start))
    return {kernel: statistics.median(times) for kernel, times in samples.items()}


def leading(items: Sequence[T], size_of: Callable[[T], int], limit: int) -> list[T]:
    """The first items up to `limit` in all (at least one): a model's leading matmuls, which
    stand for its step when the whole model would take too long to time."""
    taken, size = [], 0
    for item in items:
        if taken and size + size_of(item) > limit:
            break
        taken.append(item)
        size += size_of(item)
    return taken


def cpu_model_name() -> str:
    """/proc/cpuinfo's model name (what a plan is kept by), else the platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def plan_digest(key: dict[str, object]) -> str:
    """The file name a plan measured under `key` (what it depends on) is kept by."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def shapes_digest(shapes: object) -> str:
    """A short digest of a model's matmul shapes, for a plan's key."""
    return hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
