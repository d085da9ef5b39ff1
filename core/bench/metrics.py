"""The measurements of `plugserve bench serve`: one request's record, vLLM's aggregate
metrics under vLLM's JSON keys, and the table `vllm bench serve` prints."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
# Per-request lists that vLLM writes only with --save-detailed.
DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


@dataclass
class RequestOutput:
    """One request's measurements, in seconds (vLLM's RequestFuncOutput)."""

    prompt_len: int = 0
    success: bool = False
    generated_text: str = ""
    output_tokens: int = 0  # from the usage chunk; 0: unknown
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    start_time: float = 0.0  # perf_counter at send
    error: str = ""


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration: float,
    percentiles: Sequence[float] = (50.0, 99.0),
    count_tokens: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """vLLM's calculate_metrics: the aggregate figures under vLLM's JSON keys (ms for
    latencies). `count_tokens` counts a generated text's tokens for requests whose
    server sent no usage; without it the number of content chunks is used."""
    output_lens: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    total_input = 0
    completed = 0
    for out in outputs:
        if not out.success:
            output_lens.append(0)
            continue
        n = out.output_tokens
        if not n:
            n = count_tokens(out.generated_text) if count_tokens else 1 + len(out.itl)
        output_lens.append(n)
        total_input += out.prompt_len
        if n > 1:
            tpots.append((out.latency - out.ttft) / (n - 1))
        itls += out.itl
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        completed += 1
    total_output = sum(output_lens)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    result.update(_peaks(outputs))
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        data = values or [0.0]  # as vLLM: an empty list reports zeros
        result[f"mean_{name}_ms"] = float(np.mean(data)) * 1000
        result[f"median_{name}_ms"] = float(np.median(data)) * 1000
        result[f"std_{name}_ms"] = float(np.std(data)) * 1000
        for p in percentiles:
            result[f"p{_p_word(p)}_{name}_ms"] = float(np.percentile(data, p)) * 1000
    result["input_lens"] = [out.prompt_len for out in outputs]
    result["output_lens"] = output_lens
    result["ttfts"] = [out.ttft for out in outputs]
    result["itls"] = [out.itl for out in outputs]
    result["generated_texts"] = [out.generated_text for out in outputs]
    result["errors"] = [out.error for out in outputs]
    return result


def _peaks(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """Peak output tokens in any one-second bucket, and the requests active then (vLLM's
    max_output_tokens_per_s / max_concurrent_requests)."""
    done = [o for o in outputs if o.success]
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(o.start_time for o in done)
    t1 = max(o.start_time + o.latency for o in done)
    buckets = int(np.ceil(t1 - t0)) + 1
    tokens = np.zeros(buckets)
    active = np.zeros(buckets)
    for o in done:
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        for t in times:
            b = int(t - t0)
            if 0 <= b < buckets:
                tokens[b] += 1
        first, last = int(o.start_time - t0), int(o.start_time + o.latency - t0)
        active[first : min(last, buckets - 1) + 1] += 1
    return {
        "max_output_tokens_per_s": float(tokens.max()),
        "max_concurrent_requests": int(active.max()),
    }


def format_result(
    result: dict[str, Any],
    percentile_metrics: Sequence[str] = METRICS,
    percentiles: Sequence[float] = (50.0, 99.0),
) -> str:
    """The table `vllm bench serve` prints, line for line."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    rate = result.get("request_rate", "inf")
    if rate not in ("inf", None) and float(rate) != float("inf"):
        row("Request rate configured (RPS):", float(rate), ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"], ".2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for metric in METRICS:
        if metric not in percentile_metrics:
            continue
        name, header = METRIC_NAMES[metric]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", result[f"mean_{metric}_ms"], ".2f")
        row(f"Median {name} (ms):", result[f"median_{metric}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_p_word(p)} {name} (ms):", result[f"p{_p_word(p)}_{metric}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
