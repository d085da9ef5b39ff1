"""benchmarks/engine_overhead.py's in-process part: every phase of a decode step is
measured, and the phases account for the whole step."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def overhead() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import engine_overhead
    finally:
        sys.path.remove(str(BENCHMARKS))
    return engine_overhead


def test_phases_cover_each_step_at_every_row_count(overhead: ModuleType) -> None:
    results = overhead.measure_phases([1, 4], steps=3)
    assert list(results) == [1, 4]
    for per_step in results.values():
        # Every phase ran (nothing measured zero), and with "other" they sum to the step.
        assert all(per_step[phase] > 0 for phase in overhead.PHASES if phase != "other")
        total = sum(per_step[phase] for phase in overhead.PHASES)
        assert total == pytest.approx(per_step["total"])
        assert per_step["host"] == pytest.approx(per_step["total"] - per_step["forward"])
    table = overhead.phases_table(results)
    assert table.splitlines()[0].startswith("| rows | schedule | inputs | forward |")
    assert len(table.splitlines()) == 4
