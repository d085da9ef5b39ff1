"""(d) `plugserve serve` on the GPU, as a user starts it, checked through HTTP.

One server (bf16, the given attention backend) on a random-weights model; then:
a streamed chat completion, the same greedy completion twice (same text), a `choice`
and a `json_schema` constraint through the structured-output backend, a 400 in
OpenAI's error shape for a bad field, vLLM's metric names on /metrics, the serving
benchmark at concurrency 1 and 64 (the project's `plugserve bench serve` client), and
exit status 0 after SIGTERM with no process left behind. Start-up time is measured from
the process start to the first healthy /health.

    python benchmarks/gpu/serve_check.py --model DIR --attention flashinfer
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import httpx

from plugserve.bench.client import build_parser, run_benchmark
from plugserve.bench.plugserve_server import PlugserveServer

METRIC_NAMES = (
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
)
SCHEMA = {
    "type": "object",
    # Bounded, so that even a random-weights model's answer ends within max_tokens.
    "properties": {
        "name": {"type": "string", "enum": ["Ada", "Grace"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def server(model: str, attention: str, log: Path) -> PlugserveServer:
    settings = [
        "--model", model,
        "--stack.attention", attention,
        "--max-num-seqs", "128",
        "--max-model-len", "2048",
        "--gpu-memory-utilization", "0.5",
    ]  # fmt: skip
    return PlugserveServer(log, settings=settings)


def chat(client: httpx.Client, content: str, **extra: Any) -> dict[str, Any]:
    body = {
        "model": served_model(client),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 32,
        "temperature": 0,
        **extra,
    }
    response = client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


def served_model(client: httpx.Client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def streamed_chat(client: httpx.Client) -> str:
    body = {
        "model": served_model(client),
        "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts, usage, done = [], None, False
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                parts.append(choice["delta"].get("content") or "")
    assert done, "the stream did not end with [DONE]"
    assert usage and usage["completion_tokens"] == 24, f"usage {usage}"
    return "".join(parts)


def checks(client: httpx.Client) -> dict[str, Callable[[], str]]:
    def stream() -> str:
        return f"{len(streamed_chat(client))} characters streamed"

    def greedy_repeats() -> str:
        a = chat(client, "Write a haiku.")["choices"][0]["message"]["content"]
        b = chat(client, "Write a haiku.")["choices"][0]["message"]["content"]
        assert a == b, f"{a!r} != {b!r}"
        return "same text twice"

    def choice() -> str:
        options = ["red", "green", "blue"]
        got = chat(client, "A colour?", structured_outputs={"choice": options})
        text = got["choices"][0]["message"]["content"]
        assert text in options, text
        return text

    def json_schema() -> str:
        got = chat(
            client,
            "A person.",
            max_tokens=128,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            },
        )
        assert got["choices"][0]["finish_reason"] == "stop", got["choices"][0]
        value = json.loads(got["choices"][0]["message"]["content"])
        assert set(value) == {"name", "age"} and isinstance(value["age"], int), value
        return json.dumps(value)

    def bad_input() -> str:
        response = client.post(
            "/v1/chat/completions",
            json={
                "model": served_model(client),
                "messages": [{"role": "user", "content": "x"}],
                "temperature": -1,
            },
        )
        assert response.status_code == 400, response.status_code
        error = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error), error
        return error["message"][:80]

    def metrics() -> str:
        text = client.get("/metrics").text
        missing = [name for name in METRIC_NAMES if name not in text]
        assert not missing, f"missing {missing}"
        return f"{len(METRIC_NAMES)} names present"

    return {
        "streamed chat": stream,
        "greedy repeats": greedy_repeats,
        "choice": choice,
        "json_schema": json_schema,
        "400 on bad input": bad_input,
        "vLLM metric names": metrics,
    }


def bench(base: str, model: str, concurrency: int, num_prompts: int) -> dict[str, Any]:
    args = build_parser().parse_args(
        [
            "--base-url", base,
            "--tokenizer", model,
            "--random-input-len", "128",
            "--random-output-len", "128",
            "--ignore-eos",
            "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency),
            "--disable-tqdm",
        ]
    )  # fmt: skip
    result = run_benchmark(args)
    keys = ("completed", "output_throughput", "median_ttft_ms", "median_itl_ms", "p99_itl_ms")
    return {key: result.get(key) for key in keys}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--attention", default="flashinfer")
    parser.add_argument("--bench-prompts", type=int, default=256)
    args = parser.parse_args()
    log = common.WORK / f"serve-{args.attention}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"attention": args.attention, "checks": {}, "bench": {}}
    served = server(args.model, args.attention, log).launch()
    base = served.base_url
    try:
        report["startup_s"] = served.wait_healthy(timeout=300)
        print(f"(d) {args.attention}: healthy after {report['startup_s']:.1f} s", flush=True)
        with httpx.Client(base_url=base, timeout=120) as client:
            for name, check in checks(client).items():
                try:
                    report["checks"][name] = {"passed": True, "detail": check()}
                except Exception as exc:
                    report["checks"][name] = {"passed": False, "detail": f"{exc!r}"[:300]}
                print(f"    {name}: {report['checks'][name]}", flush=True)
        for concurrency, prompts in ((1, 16), (64, args.bench_prompts)):
            report["bench"][f"c={concurrency}"] = bench(base, args.model, concurrency, prompts)
            print(f"    bench c={concurrency}: {report['bench'][f'c={concurrency}']}", flush=True)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"(d) {args.attention} FAILED: {report['error']}", flush=True)
    finally:
        stopped = served.stop(timeout=60)
        report["exit_code"] = (
            "killed after 60 s" if stopped.ignored_stop_signal else stopped.returncode
        )
        report["outlived"] = list(stopped.outlived)
    print(f"    exit after SIGTERM: {report['exit_code']}", flush=True)
    report["passed"] = (
        "error" not in report
        and report["exit_code"] == 0
        and not report["outlived"]
        and all(c["passed"] for c in report["checks"].values())
        and all(b["completed"] for b in report["bench"].values())
    )
    common.save(f"serve_{args.attention}", report)
    print(f"(d) {args.attention}: {'PASS' if report['passed'] else 'FAIL'}", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
