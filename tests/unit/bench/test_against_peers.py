"""benchmarks/against_peers.py's table and acceptance criteria, from made-up results (no
servers)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its sibling, serving.py
    try:
        import against_peers
    finally:
        sys.path.remove(str(BENCHMARKS))
    return against_peers


def row(run, system, workload, conc, **values):
    return {"run": run, "system": system, "workload": workload, "concurrency": conc, **values}


def results(plugserve_c8: float) -> list[dict]:
    rows = []
    for system, tok_s, ttft, itl, prefill, long_ttft in (
        ("vllm", 200.0, 60.0, 30.0, 2600.0, 330.0),
        ("plugserve", None, 50.0, 15.0, 2700.0, 290.0),
    ):
        rows.append(row(0, system, "ref", 1, median_ttft_ms=ttft, median_itl_ms=itl))
        rows.append(row(0, system, "ref", 8, output_throughput=tok_s or plugserve_c8))
        rows.append(row(0, system, "long", 1, median_ttft_ms=long_ttft))
        rows.append(row(0, system, "long", 8, prefill_throughput=prefill))
    return rows


def test_each_criterion_is_judged_against_its_own_reference(peers: ModuleType) -> None:
    checks = {c["criterion"]: c for c in peers.acceptance(results(260.0), 0, floor_ms=12.0)}
    c8 = checks["c=8 out tok/s >= 1.25x vLLM"]
    assert c8["ratio"] == pytest.approx(1.3) and c8["passed"] is True
    assert checks["c=1 TTFT p50 <= vLLM"]["passed"] is True
    itl = checks["c=1 ITL p50 <= 1.5x bandwidth floor"]
    assert itl["ratio"] == pytest.approx(1.25) and itl["passed"] is True
    # 2700 / 2600 is below the 1.2x asked; 300 / 330 ms is within 0.9x
    assert checks["1024-token prompts: c=8 prefill tok/s >= 1.2x vLLM"]["passed"] is False
    assert checks["1024-token prompts: c=1 TTFT p50 <= 0.9x vLLM"]["passed"] is True
    # c=32 was not run: neither passed nor failed
    c32 = checks["c=32 out tok/s >= 1.25x vLLM"]
    assert c32["passed"] is None and c32["ratio"] is None


def test_a_throughput_below_the_threshold_fails_and_no_floor_is_no_verdict(
    peers: ModuleType,
) -> None:
    checks = {c["criterion"]: c for c in peers.acceptance(results(240.0), 0, floor_ms=None)}
    assert checks["c=8 out tok/s >= 1.25x vLLM"]["passed"] is False
    assert checks["c=1 ITL p50 <= 1.5x bandwidth floor"]["passed"] is None
    table = peers.markdown_acceptance(list(checks.values()))
    assert "**FAIL**" in table and "**pass**" in table and "n/a" in table


def test_int8_rows_are_judged_against_bf16_and_llama_server(peers: ModuleType) -> None:
    rows = [
        row(0, "plugserve", "ref", 1, median_itl_ms=12.0),
        row(0, "plugserve_int8", "ref", 1, median_itl_ms=6.0),
        row(0, "llamaserver", "ref", 1, median_itl_ms=9.0),
    ]
    checks = {c["criterion"]: c for c in peers.acceptance(rows, 0, floor_ms=None)}
    against_bf16 = checks["int8: c=1 ITL p50 <= 0.6x bf16's"]
    assert against_bf16["system"] == "plugserve_int8" and against_bf16["value"] == 6.0
    assert against_bf16["ratio"] == pytest.approx(0.5) and against_bf16["passed"] is True
    against_llama = checks["int8: c=1 ITL p50 < llama-server Q4_1's"]
    assert against_llama["reference_value"] == 9.0 and against_llama["passed"] is True
    # equal is not below
    rows[1] = row(0, "plugserve_int8", "ref", 1, median_itl_ms=9.0)
    checks = {c["criterion"]: c for c in peers.acceptance(rows, 0, floor_ms=None)}
    assert checks["int8: c=1 ITL p50 < llama-server Q4_1's"]["passed"] is False
    assert checks["int8: c=1 ITL p50 <= 0.6x bf16's"]["passed"] is False


def test_the_table_puts_runs_side_by_side(peers: ModuleType) -> None:
    rows = [
        row(0, "vllm", "ref", 8, output_throughput=213.7),
        row(1, "vllm", "ref", 8, output_throughput=214.5),
        row(0, "plugserve", "ref", 8, output_throughput=186.6),
    ]
    table = peers.markdown_table(rows, [0, 1], peers.columns([8], []))
    assert "| plugserve | 186.6 / — |" in table
    assert "| vLLM CPU | 213.7 / 214.5 |" in table
    # plugserve first; a system without results has no row
    assert table.index("plugserve") < table.index("vLLM") and "llama" not in table


def test_columns_follow_the_concurrency_levels(peers: ModuleType) -> None:
    headings = [h for h, _, _, _ in peers.columns([1, 8, 32], [1, 8])]
    assert headings == [
        "c=1 tok/s",
        "c=1 TTFT p50 ms",
        "c=1 ITL p50 ms",
        "c=8 tok/s",
        "c=32 tok/s",
        "long c=1 TTFT p50 ms",
        "long c=8 prefill tok/s",
        "long c=8 TTFT p50 ms",
    ]


def test_prefill_throughput_is_input_tokens_over_the_duration(peers: ModuleType) -> None:
    raw = {"total_input_tokens": 65536, "duration": 32.0, "median_ttft_ms": 1050.0}
    summary = peers.summarize(raw)
    assert summary["prefill_throughput"] == 2048.0
    assert summary["median_ttft_ms"] == 1050.0 and summary["failed"] is None
