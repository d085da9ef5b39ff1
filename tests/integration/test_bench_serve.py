"""`plugserve bench serve` against a live server: the command line as a user runs it, its
result checked for content and against the server's own /metrics counters."""

from __future__ import annotations

import json
import subprocess

import pytest

from plugserve.bench.plugserve_server import PlugserveServer, plugserve_command

from .conftest import MODEL, REPO_ROOT

# Transport-agnostic: the shared zmq server serves every test here once.

NUM_PROMPTS = 4
NUM_WARMUPS = 1
INPUT_LEN = 16
OUTPUT_LEN = 8
BENCH_TIMEOUT_S = 300


def _finished(metrics: dict[str, float], reason: str) -> float:
    return metrics[f'engine_requests_finished_total{{reason="{reason}"}}']


def test_bench_serve_against_a_live_server(server: PlugserveServer, tmp_path):
    before = server.wait_idle(timeout=30)
    assert before["num_requests_running"] == 0
    command = [
        *plugserve_command(),
        "bench", "serve",
        "--base-url", server.base_url,
        "--num-prompts", str(NUM_PROMPTS),
        "--num-warmups", str(NUM_WARMUPS),
        "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN),
        "--max-concurrency", "2",
        "--ignore-eos",
        "--disable-tqdm",
        "--save-result", "--save-detailed",
        "--result-dir", str(tmp_path),
        "--result-filename", "result.json",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "requests failed" not in done.stderr, done.stderr
    table = dict(line.split(":", 1) for line in done.stdout.splitlines() if line.count(":") == 1)
    assert table["Successful requests"].strip() == str(NUM_PROMPTS), done.stdout
    assert table["Failed requests"].strip() == "0", done.stdout
    result = json.loads((tmp_path / "result.json").read_text())

    # Every request answered in full: the prompts' and outputs' lengths as asked.
    assert result["model_id"] == MODEL
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["errors"] == [""] * NUM_PROMPTS
    assert result["input_lens"] == [INPUT_LEN] * NUM_PROMPTS
    assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS  # ignore_eos: all of them
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert all(text for text in result["generated_texts"])

    # Timing: one streamed chunk per token, so a TTFT and OUTPUT_LEN - 1 gaps a request,
    # all positive; each request's latency (TTFT plus its gaps) fits in the run.
    ttfts, itls = result["ttfts"], result["itls"]
    assert len(ttfts) == len(itls) == NUM_PROMPTS
    assert all(t > 0 for t in ttfts)
    assert all(len(gaps) == OUTPUT_LEN - 1 and all(g > 0 for g in gaps) for gaps in itls)
    latencies = [t + sum(gaps) for t, gaps in zip(ttfts, itls, strict=True)]
    assert max(latencies) <= result["duration"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p50", "p99"):
            assert result[f"{stat}_{name}_ms"] > 0, f"{stat}_{name}_ms"
    assert result["mean_ttft_ms"] == pytest.approx(1000 * sum(ttfts) / NUM_PROMPTS)
    assert result["mean_e2el_ms"] == pytest.approx(1000 * sum(latencies) / NUM_PROMPTS)
    pooled = [g for gaps in itls for g in gaps]
    assert result["mean_itl_ms"] == pytest.approx(1000 * sum(pooled) / len(pooled))
    assert result["request_throughput"] == pytest.approx(NUM_PROMPTS / result["duration"])

    # The server saw exactly these requests (and the warm-up), each run to its length.
    after = server.wait_idle(timeout=30)
    assert after["num_requests_running"] == 0 and after["kv_cache_usage"] == 0
    num_requests = NUM_PROMPTS + NUM_WARMUPS

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta('engine_requests_total{engine="0"}') == num_requests
    assert delta("engine_generated_tokens_total") == num_requests * OUTPUT_LEN
    finished = {r: _finished(after, r) - _finished(before, r) for r in ("stop", "abort", "error")}
    assert finished == {"stop": 0, "abort": 0, "error": 0}
    assert _finished(after, "length") - _finished(before, "length") == num_requests
