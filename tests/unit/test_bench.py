"""`plugserve bench serve` without a server: the random dataset, the SSE client against
mocked responses, vLLM's metric definitions and vLLM's printed layout."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from plugserve import bench
from plugserve.cli import build_parser, main

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return bench.get_tokenizer(str(smollm2_path))


# --------------------------------------------------------------------------- dataset


@pytest.mark.parametrize("seed", [0, 1, 8, 32])
@pytest.mark.parametrize("length", [1, 2, 7, 32, 128, 300])
def test_random_prompts_have_exactly_n_tokens(tokenizer, length, seed):
    prompts = bench.sample_random_prompts(tokenizer, 6, length, seed)
    assert len(prompts) == 6
    for text, n in prompts:
        assert n == length
        assert len(tokenizer.encode(text, add_special_tokens=False)) == length
    assert len({text for text, _ in prompts}) == 6 or length <= 2


def test_random_prompts_are_seeded(tokenizer):
    a = bench.sample_random_prompts(tokenizer, 4, 64, seed=3)
    assert a == bench.sample_random_prompts(tokenizer, 4, 64, seed=3)
    assert a != bench.sample_random_prompts(tokenizer, 4, 64, seed=4)


def test_random_prompts_leave_out_special_tokens(tokenizer):
    allowed = set(bench.allowed_token_ids(tokenizer).tolist())
    assert not allowed & set(tokenizer.all_special_ids)
    for text, _ in bench.sample_random_prompts(tokenizer, 8, 128, seed=0):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert not set(ids) & set(tokenizer.all_special_ids)


class _GrowingTokenizer:
    """Every text re-encodes to one token more than it was decoded from."""

    all_special_ids: tuple[int, ...] = ()

    def decode(self, ids):
        return " ".join(str(i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [1, *(int(t) for t in text.split())]


def test_random_prompt_fails_loudly_when_the_length_is_unreachable():
    rng = np.random.default_rng(0)
    with pytest.raises(RuntimeError, match="exactly 5 tokens"):
        bench.random_prompt(_GrowingTokenizer(), rng, np.arange(2, 50), 5)
    with pytest.raises(ValueError):
        bench.random_prompt(_GrowingTokenizer(), rng, np.arange(2, 50), 0)


# --------------------------------------------------------------------------- metrics


def _outputs():
    ok = bench.RequestOutput
    return [
        ok(10, True, "abcd", 4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2, start_time=0.0),
        ok(10, True, "a b", 0, ttft=0.3, itl=[0.1], latency=0.4, start_time=0.0),  # no usage
        ok(10, False, "", 0, error="boom"),
        ok(10, True, "x", 1, ttft=0.05, itl=[], latency=0.05, start_time=1.5),  # one token
    ]


def test_metrics_follow_vllm_definitions():
    r = bench.calculate_metrics(_outputs(), 2.0, [50, 99, 99.9], count_tokens=lambda t: 2)
    assert r["completed"] == 3
    assert r["failed"] == 1
    assert r["total_input_tokens"] == 30  # successful requests only
    assert r["total_output_tokens"] == 4 + 2 + 1
    assert r["output_lens"] == [4, 2, 0, 1]
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(3.5)
    assert r["total_token_throughput"] == pytest.approx(18.5)

    ttfts = [0.1, 0.3, 0.05]
    tpots = [(0.2 - 0.1) / 3, (0.4 - 0.3) / 1]  # not for the one-token request
    itls = [0.02, 0.03, 0.05, 0.1]  # every gap of every request
    e2els = [0.2, 0.4, 0.05]
    assert r["mean_ttft_ms"] == pytest.approx(150.0)
    assert r["median_ttft_ms"] == pytest.approx(100.0)
    assert r["p99_ttft_ms"] == pytest.approx(100 + 0.98 * 200)  # linear interpolation
    assert r["mean_tpot_ms"] == pytest.approx(1000 * (1 / 30 + 0.1) / 2)
    assert r["p99_tpot_ms"] == pytest.approx(1000 * (1 / 30 + 0.99 * (0.1 - 1 / 30)))
    assert r["mean_itl_ms"] == pytest.approx(50.0)
    assert r["median_itl_ms"] == pytest.approx(40.0)
    assert r["p50_itl_ms"] == pytest.approx(40.0)
    assert r["p99_itl_ms"] == pytest.approx(1000 * (0.05 + 0.97 * 0.05))
    assert r["mean_e2el_ms"] == pytest.approx(650 / 3)
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for p in (50, 99, 99.9):
            key = f"p{bench._p_word(p)}_{name}_ms"
            assert r[key] == pytest.approx(1000 * np.percentile(values, p)), key
        assert r[f"std_{name}_ms"] == pytest.approx(1000 * np.std(values))
    # tokens at .1 .12 .15 .2 (A) and .3 .4 (B) in second 0, at 1.55 (D) in second 1
    assert r["max_output_tokens_per_s"] == 6
    assert r["max_concurrent_requests"] == 2


def test_metrics_count_chunks_without_usage_or_tokenizer():
    r = bench.calculate_metrics(_outputs(), 2.0)
    assert r["output_lens"] == [4, 2, 0, 1]  # 1 + len(itl) for the request without usage


def test_metrics_of_nothing_are_zeros():
    r = bench.calculate_metrics([bench.RequestOutput(5, error="x")], 1.0)
    assert r["completed"] == 0 and r["failed"] == 1
    assert r["mean_ttft_ms"] == 0 and r["p99_itl_ms"] == 0
    assert r["max_output_tokens_per_s"] == 0


# --------------------------------------------------------------------------- layout

VLLM_LINES = [
    "============ Serving Benchmark Result ============",
    "---------------Time to First Token----------------",
    "-----Time per Output Token (excl. 1st token)------",
    "---------------Inter-token Latency----------------",
    "----------------End-to-end Latency----------------",
    "==================================================",
]


def test_layout_is_vllms():
    r = bench.calculate_metrics(_outputs(), 2.0, [50, 99])
    r["max_concurrency"] = 8
    text = bench.format_result(r, bench.METRICS, [50, 99])
    lines = text.splitlines()
    for line in VLLM_LINES:
        assert line in lines
    assert lines[0] == VLLM_LINES[0] and lines[-1] == VLLM_LINES[-1]
    assert f"{'Successful requests:':<40} {3:<10}" in lines
    assert f"{'Maximum request concurrency:':<40} {8:<10}" in lines
    assert f"{'Benchmark duration (s):':<40} {2.0:<10.2f}" in lines
    assert f"{'Output token throughput (tok/s):':<40} {3.5:<10.2f}" in lines
    assert f"{'Mean TTFT (ms):':<40} {150.0:<10.2f}" in lines
    for key in ("Median TPOT (ms):", "P50 ITL (ms):", "P99 ITL (ms):", "P99 E2EL (ms):"):
        assert any(line.startswith(key) for line in lines), key
    assert all(len(line) <= 51 for line in lines)


def test_layout_prints_only_the_chosen_metrics():
    r = bench.calculate_metrics(_outputs(), 2.0, [99])
    lines = bench.format_result(r, ["ttft", "itl"], [99]).splitlines()
    assert VLLM_LINES[1] in lines and VLLM_LINES[3] in lines
    assert VLLM_LINES[2] not in lines and VLLM_LINES[4] not in lines
    assert not any("P50" in line for line in lines)
    assert "Maximum request concurrency" not in "\n".join(lines)


# --------------------------------------------------------------------------- client


def _sse(*events) -> bytes:
    return b"".join(
        f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events
    )


def _chunk(text):
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}], "usage": None}


def _usage(n):
    return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}


def _send(handler, body=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await bench.send_request(
                client, "http://x/v1/completions", body or {"prompt": "p"}, 7, chat=False
            )

    return asyncio.run(go())


def test_client_times_chunks_and_reads_usage():
    stream = _sse(_chunk("Hel"), _chunk("lo"), ": ping", _chunk(""), _usage(3), "[DONE]")
    out = _send(lambda request: httpx.Response(200, content=stream.replace(b"data: : ", b": ")))
    assert out.success and out.error == ""
    assert out.generated_text == "Hello"
    assert out.output_tokens == 3
    assert out.prompt_len == 7
    assert len(out.itl) == 2  # three chunks with choices
    assert 0 < out.ttft <= out.latency
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))


def test_client_reports_http_and_stream_errors():
    out = _send(lambda request: httpx.Response(400, json={"error": {"message": "bad"}}))
    assert not out.success and out.error.startswith("HTTP 400") and "bad" in out.error

    err = {"error": {"message": "engine died", "type": "server_error", "code": 500}}
    out = _send(lambda request: httpx.Response(200, content=_sse(_chunk("a"), err, "[DONE]")))
    assert not out.success and out.error == "engine died"

    out = _send(lambda request: httpx.Response(200, content=_sse("[DONE]")))
    assert not out.success and "never received" in out.error

    def refuse(request):
        raise httpx.ConnectError("refused")

    out = _send(refuse)
    assert not out.success and "refused" in out.error


def test_run_benchmark_end_to_end_on_a_mock_server(tokenizer, smollm2_path, tmp_path, capsys):
    bodies = []
    active = 0
    peak = 0

    async def handler(request):
        nonlocal active, peak
        body = json.loads(request.content)
        bodies.append(body)
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.01)
        active -= 1
        n = body["max_tokens"]
        stream = _sse(*(_chunk(f"t{i} ") for i in range(n)), _usage(n), "[DONE]")
        return httpx.Response(200, content=stream)

    args = bench.parse_args(
        [
            "--model", "m", "--tokenizer", str(smollm2_path), "--num-prompts", "6",
            "--random-input-len", "16", "--random-output-len", "5", "--max-concurrency", "2",
            "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "r.json", "--label", "mock", "--metric-percentiles", "50,99",
        ]
    )  # fmt: skip
    result = bench.run_benchmark(args, transport=httpx.MockTransport(handler))
    assert len(bodies) == 7  # one warm-up
    assert peak <= 2
    body = bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["max_tokens"] == 5
    assert body["model"] == "m"
    assert len(tokenizer.encode(body["prompt"], add_special_tokens=False)) == 16
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_input_tokens"] == 96 and result["total_output_tokens"] == 30
    assert result["max_concurrency"] == 2 and result["num_prompts"] == 6
    assert "ttfts" not in result  # detailed lists only with --save-detailed
    saved = json.loads((tmp_path / "r.json").read_text())
    for key in ("completed", "duration", "output_throughput", "p99_itl_ms", "median_ttft_ms"):
        assert saved[key] == result[key]
    assert saved["label"] == "mock"
    assert VLLM_LINES[0] in capsys.readouterr().out


# --------------------------------------------------------------------------- cli


def test_cli_parses_vllm_flags_strictly(capsys):
    args = build_parser().parse_args(
        ["bench", "serve", "--max-concurrency", "8", "--ignore-eos", "--num-prompts", "16"]
    )
    assert args.max_concurrency == 8 and args.ignore_eos and args.num_prompts == 16
    assert args.random_input_len == 128 and args.request_rate == float("inf")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--max-num-seqs", "8"])
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


class _FakeClock:
    """Stands in for asyncio.sleep: time passes only when someone sleeps."""

    def __init__(self):
        self.now = 0.0

    async def sleep(self, delay, result=None):
        assert delay >= 0
        self.now += delay
        return result


def test_poisson_arrivals_are_spread_and_seeded(monkeypatch):
    """When each request is sent, on a fake clock: all at once for rate inf, else after
    exponential gaps of mean 1/rate (Poisson arrivals), the same for the same seed."""
    clock = _FakeClock()
    monkeypatch.setattr(asyncio, "sleep", clock.sleep)

    def send_times(n, rate, seed):
        async def collect():
            return [(i, clock.now) async for i in bench._arrivals(n, rate, seed)]

        clock.now = 0.0
        sent = asyncio.run(collect())
        assert [i for i, _ in sent] == list(range(n))
        return np.array([t for _, t in sent])

    assert not send_times(5, float("inf"), 0).any()  # no waiting at all
    paced = send_times(2001, 100.0, 0)
    gaps = np.diff(paced)
    assert (gaps > 0).all()
    # Exponential gaps: mean 1/rate (10 ms), and a standard deviation as large as the mean.
    assert gaps.mean() == pytest.approx(0.01, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)
    np.testing.assert_array_equal(send_times(2001, 100.0, 0), paced)
    assert not np.allclose(send_times(2001, 100.0, 1), paced)
