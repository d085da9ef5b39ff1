"""`plugserve bench serve`: an online serving benchmark for any OpenAI-compatible server.

The client side (see plugserve.bench for the definitions): vLLM's flags, the streamed
request and its timing, the benchmark loop, the result JSON and the CLI entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.bench.dataset import EMBEDDED_MODEL, get_tokenizer, sample_random_prompts
from plugserve.bench.metrics import (
    DETAILED_FIELDS,
    METRICS,
    RequestOutput,
    calculate_metrics,
    format_result,
)

HTTP_TIMEOUT_S = 6 * 60 * 60  # vLLM's AIOHTTP_TIMEOUT: a benchmark request never times out


# --------------------------------------------------------------------------- arguments


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`vllm bench serve`'s flags, as far as this client implements them."""
    parser.add_argument("--backend", choices=("openai", "openai-chat"), default="openai")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default=None, help="default: /v1/completions (chat: ...)")
    parser.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help=f"tokenizer folder or built-in model name (default: {EMBEDDED_MODEL})",
    )
    parser.add_argument("--dataset-name", choices=("random",), default="random")
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="only 0 (exact lengths) is supported",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s with Poisson arrivals; inf (default) sends every request at t=0",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged in")
    parser.add_argument("--num-warmups", type=int, default=1)
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", default="50,99")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--save-detailed", action="store_true")
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--label", default=None)
    parser.add_argument("--disable-tqdm", action="store_true")
    return parser


def build_parser() -> argparse.ArgumentParser:
    return add_cli_args(
        argparse.ArgumentParser(prog="plugserve bench serve", description=__doc__.splitlines()[0])
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The flags as `plugserve bench serve` reads them, for callers in Python."""
    return build_parser().parse_args(list(argv))


def _split_list(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.replace(" ", ",").split(",") if s.strip()]
    if not items:
        raise ValueError(f"{what} is empty")
    return items


def _percentile_metrics(text: str) -> list[str]:
    metrics = _split_list(text, "--percentile-metrics")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown --percentile-metrics {unknown}; known: {', '.join(METRICS)}")
    return metrics


def _percentiles(text: str) -> list[float]:
    values = [float(p) for p in _split_list(text, "--metric-percentiles")]
    if any(not 0 < p < 100 for p in values):
        raise ValueError("--metric-percentiles must lie strictly between 0 and 100")
    return values


# --------------------------------------------------------------------------- requests


def request_body(args: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
    """The JSON body of one workload request, from `plugserve bench serve`'s flags."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.random_output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.extra_body:
        body.update(args.extra_body)
    return body


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(
    client: Any, url: str, body: dict[str, Any], prompt_len: int, chat: bool
) -> RequestOutput:
    """One streamed request, timed as vLLM's openai request functions time it."""
    out = RequestOutput(prompt_len=prompt_len)
    parts: list[str] = []
    first = False
    st = time.perf_counter()
    out.start_time = st
    most_recent = st
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {text[:500]}"
                return out
            async for line in response.aiter_lines():
                line = line.strip()
                if not line or line.startswith(":") or not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    continue  # read on to the end so the connection is reused
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    out.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    continue
                if choices := chunk.get("choices"):
                    timestamp = time.perf_counter()
                    if not first:
                        first = True
                        out.ttft = timestamp - st
                    else:
                        out.itl.append(timestamp - most_recent)
                    most_recent = timestamp
                    parts.append(_chunk_text(choices[0], chat))
                elif usage := chunk.get("usage"):
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
        out.generated_text = "".join(parts)
        out.latency = most_recent - st
        if not first and not out.error:
            out.error = "never received a chunk with choices to time TTFT"
        out.success = not out.error
    except Exception as exc:
        out.success = False
        out.error = f"{type(exc).__name__}: {exc}"
    return out


# --------------------------------------------------------------------------- the run


def first_model_id(base_url: str) -> str:
    """The first model id the server at `base_url` lists."""
    import httpx

    try:
        response = httpx.get(f"{base_url}/v1/models", timeout=30.0)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot list the models at {base_url}/v1/models: {exc}") from exc
    data = response.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


async def _arrivals(n: int, rate: float, seed: int):
    """Indices 0..n-1, at once for rate inf, else spaced by exponential gaps (Poisson)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


async def _benchmark(
    args: argparse.Namespace,
    url: str,
    model: str,
    prompts: list[tuple[str, int]],
    transport: Any = None,
) -> tuple[list[RequestOutput], float]:
    import httpx

    chat = args.backend == "openai-chat"
    limit = args.max_concurrency
    semaphore = asyncio.Semaphore(limit) if limit else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(HTTP_TIMEOUT_S)
    pbar: Any = None

    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:

        async def one(prompt: str, prompt_len: int) -> RequestOutput:
            body = request_body(args, model, prompt)
            if semaphore is None:
                out = await send_request(client, url, body, prompt_len, chat)
            else:
                async with semaphore:
                    out = await send_request(client, url, body, prompt_len, chat)
            if pbar is not None:
                pbar.update(1)
            return out

        if args.num_warmups > 0:
            print(f"Warming up with {args.num_warmups} requests...")
            warm = [prompts[i % len(prompts)] for i in range(args.num_warmups)]
            warm_outs = await asyncio.gather(
                *(send_request(client, url, request_body(args, model, p), n, chat) for p, n in warm)
            )
            failed = [o for o in warm_outs if not o.success]
            if failed:
                raise RuntimeError(f"warm-up request failed: {failed[0].error.strip()}")
            print("Warmup run completed.")

        print("Starting main benchmark run...")
        print(f"Traffic request rate: {args.request_rate}")
        if args.request_rate != float("inf"):
            print("Burstiness factor: 1.0 (Poisson process)")
        print(f"Maximum request concurrency: {limit}")
        if not args.disable_tqdm:
            from tqdm import tqdm

            pbar = tqdm(total=len(prompts))
        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(prompts), args.request_rate, args.seed):
            text, n = prompts[i]
            tasks.append(asyncio.create_task(one(text, n)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return outputs, duration


def run_benchmark(args: argparse.Namespace, *, transport: Any = None) -> dict[str, Any]:
    """Run the benchmark `args` describes (see parse_args), print vLLM's table, save the
    JSON when asked, and return the result with vLLM's keys (the per-request lists only
    with --save-detailed). `transport`: an httpx async transport to use instead of the
    network (tests)."""
    if args.dataset_name != "random":
        raise ValueError("only --dataset-name random is supported")
    if args.random_range_ratio != 0:
        raise ValueError("only --random-range-ratio 0 is supported")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be positive (inf: all at t=0)")
    metrics = _percentile_metrics(args.percentile_metrics)
    percentiles = _percentiles(args.metric_percentiles)
    base_url = args.base_url.rstrip("/")
    endpoint = args.endpoint or (
        "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    )
    url = base_url + endpoint
    model = args.model or first_model_id(base_url)
    tokenizer_id = args.tokenizer or EMBEDDED_MODEL
    tokenizer = get_tokenizer(tokenizer_id)
    prompts = sample_random_prompts(tokenizer, args.num_prompts, args.random_input_len, args.seed)

    outputs, duration = asyncio.run(_benchmark(args, url, model, prompts, transport))

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    measured = calculate_metrics(outputs, duration, percentiles, count_tokens)
    rate = args.request_rate if args.request_rate != float("inf") else "inf"
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": str(tokenizer_id),
        "num_prompts": args.num_prompts,
        "request_rate": rate,
        "burstiness": 1.0,
        "max_concurrency": args.max_concurrency,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        **measured,
    }
    if not args.save_detailed:
        for name in DETAILED_FIELDS:
            result.pop(name, None)
    print(format_result(result, metrics, percentiles), flush=True)
    errors = [o.error.strip() for o in outputs if not o.success]
    if errors:
        last_line = errors[0].splitlines()[-1] if errors[0] else "(no message)"
        print(f"{len(errors)} requests failed; the first error: {last_line}", file=sys.stderr)
    if args.save_result:
        _save(args, result, model)
    return result


def _save(args: argparse.Namespace, result: dict[str, Any], model: str) -> Path:
    name = args.result_filename
    if not name:
        label = args.label or args.backend
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = f"{label}-{args.request_rate}qps{conc}-{model.split('/')[-1]}-{result['date']}.json"
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {path}")
    return path


def main(args: argparse.Namespace) -> int:
    """Entry point of `plugserve bench serve`: one line on stderr and exit 1 on error."""
    try:
        run_benchmark(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        print(f"plugserve bench serve: error: {exc}", file=sys.stderr)
        return 1
    return 0
