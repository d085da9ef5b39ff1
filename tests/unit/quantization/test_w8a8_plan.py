"""The W8A8 kernel plan: each row bucket runs the candidate that timed fastest at the
bucket's row count, and a plan measured once is read back
from the plugserve cache on the next start instead of timed again."""

from __future__ import annotations

import pytest
import torch

from plugserve_plugins.linear_methods.w8a8_plan import (
    AMX,
    INT_MM,
    ROW_BUCKETS,
    VNNI,
    VNNI_TILED,
    MeasuredMatmul,
    W8A8Plan,
    measure,
    plan_for,
)

# Each kernel's cost (in seconds of the fake clock) at a row count.
COSTS = {
    VNNI: lambda rows: rows,
    VNNI_TILED: lambda rows: rows + 1,
    AMX: lambda rows: 5 + rows / 4,
    INT_MM: lambda rows: 10 + rows / 8,
}


class FakeClock:
    """A clock that moves only when a matmul runs, by COSTS."""

    def __init__(self) -> None:
        self.now = 0.0
        self.runs: list[tuple[str, int]] = []

    def run(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        self.runs.append((kernel, x.shape[0]))
        self.now += COSTS[kernel](x.shape[0])
        return x


def test_each_bucket_takes_the_candidate_fastest_at_its_row_count() -> None:
    clock = FakeClock()
    matmuls = [MeasuredMatmul(clock.run, in_features=64, out_features=32)]
    candidates = [[VNNI, VNNI_TILED]] + [[VNNI, AMX, INT_MM] for _ in ROW_BUCKETS[1:]]
    plan = measure(matmuls, candidates, clock=lambda: clock.now)
    # 1 row: 1 / 2; 8 rows: 8 / 7 / 11; 32: 32 / 13 / 14; 128: 128 / 37 / 26; 512: 512 / 133 / 74.
    assert plan.by_bucket == (VNNI, AMX, AMX, INT_MM, INT_MM)
    assert set(plan.times_ms[0]) == {VNNI, VNNI_TILED}
    assert set(plan.times_ms[1]) == {VNNI, AMX, INT_MM}
    assert plan.for_rows(1) == VNNI and plan.for_rows(300) == INT_MM


def test_a_measured_plan_is_kept_and_read_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PLUGSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PLUGSERVE_REMEASURE_KERNELS", raising=False)
    clock = FakeClock()
    matmuls = [MeasuredMatmul(clock.run, in_features=64, out_features=32)]
    first = plan_for(matmuls)
    runs = len(clock.runs)
    again = plan_for(matmuls)
    assert len(clock.runs) == runs  # read back, not timed again
    assert again.by_bucket == first.by_bucket and isinstance(again, W8A8Plan)
    if runs:  # more than one candidate here: measured, then cached
        assert again.from_cache and not first.from_cache
