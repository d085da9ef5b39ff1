"""`plugserve bench serve`: an online serving benchmark for any OpenAI-compatible server.

A re-implementation of `vllm bench serve` for the one workload plugserve is measured on:
random-token prompts of an exact length, streaming /v1/completions (or chat), all
requests created at t=0 (or Poisson arrivals) and capped by --max-concurrency. Its
definitions, its printed table and its JSON keys are vLLM's, so figures from either
client can sit side by side:

* TTFT: from sending the request to the first streamed chunk carrying choices;
* ITL: the gaps between successive such chunks, pooled over all requests;
* TPOT: per request, (E2EL - TTFT) / (output tokens - 1), for requests of more than one
  output token;
* E2EL: from sending the request to its last chunk carrying choices;
* output tokens: the usage chunk's completion_tokens, else the generated text
  re-tokenized.

    plugserve bench serve --base-url http://127.0.0.1:8000 --max-concurrency 8 --ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

EMBEDDED_MODEL = "smollm2-135m-instruct"
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
# Per-request lists that vLLM writes only with --save-detailed.
DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")
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


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


# --------------------------------------------------------------------------- dataset


@lru_cache(maxsize=4)
def get_tokenizer(name: str | None) -> Any:
    """A tokenizer folder, or a built-in model name (default: the embedded model)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    path: str | Path = name or EMBEDDED_MODEL
    if not Path(path).expanduser().is_dir():
        from plugserve.worker.model_loader import BUILTIN_MODELS, resolve_model_path

        if str(path).lower() in BUILTIN_MODELS:
            path = resolve_model_path(str(path))
    return AutoTokenizer.from_pretrained(path)


def allowed_token_ids(tokenizer: Any) -> np.ndarray:
    """Every id of the vocabulary but the special and added tokens."""
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return np.array([i for i in range(len(tokenizer)) if i not in excluded], dtype=np.int64)


def random_prompt(
    tokenizer: Any,
    rng: np.random.Generator,
    allowed: np.ndarray,
    length: int,
    *,
    draws: int = 10,
    adjustments: int = 10,
) -> str:
    """Text that tokenizes (without special tokens) to exactly `length` tokens.

    Random ids decode to text that may re-encode to a different count (merges across
    the joins); the re-encoded ids are cut or topped up with fresh random ids and
    checked again. Raises RuntimeError when no attempt lands on the length."""
    if length < 1:
        raise ValueError(f"a prompt needs at least one token, got {length}")
    last = -1
    for _ in range(draws):
        ids = rng.choice(allowed, size=length).tolist()
        for _ in range(adjustments):
            text = tokenizer.decode(ids)
            got = tokenizer.encode(text, add_special_tokens=False)
            last = len(got)
            if last == length:
                return text
            if last > length:
                ids = got[:length]
            else:
                ids = got + rng.choice(allowed, size=length - last).tolist()
    raise RuntimeError(
        f"could not build a random prompt of exactly {length} tokens "
        f"({draws}x{adjustments} attempts, the last re-encoded to {last})"
    )


def sample_random_prompts(
    tokenizer: Any, num_prompts: int, input_len: int, seed: int
) -> list[tuple[str, int]]:
    """`num_prompts` (text, token count) pairs from a numpy RNG seeded with `seed`."""
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    prompts = []
    for _ in range(num_prompts):
        text = random_prompt(tokenizer, rng, allowed, input_len)
        n = len(tokenizer.encode(text, add_special_tokens=False))
        if n != input_len:  # random_prompt checked it: this would be a bug
            raise RuntimeError(f"random prompt has {n} tokens, wanted {input_len}")
        prompts.append((text, n))
    return prompts


# --------------------------------------------------------------------------- requests


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


def _payload(args: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
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


# --------------------------------------------------------------------------- metrics


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


# --------------------------------------------------------------------------- the run


def _first_model_id(base_url: str) -> str:
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
            body = _payload(args, model, prompt)
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
                *(send_request(client, url, _payload(args, model, p), n, chat) for p, n in warm)
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
    model = args.model or _first_model_id(base_url)
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


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
