"""c=1 ITL against the bandwidth floor, one request at a time, the floor read around each.

On a shared VM the memory's read rate flips between phases within seconds (floors far
apart around one short benchmark run: docs/benchmarks-history.md, "Figures from code
comments"), so a floor read before and after a whole c=1 run may describe a different
phase from the one its tokens streamed in. Here
each request (the serving workload's: a random prompt of exactly 128 tokens, 128 output
tokens with EOS ignored, temperature 0, streamed) lies between two reads of the server's
own weights (`GET /bench/weight_read`), and its ITL median is set against them. Requests
whose two floors differ by more than --stable are counted apart: their phase changed.

    .venv/bin/python benchmarks/itl_floor.py --base-url http://127.0.0.1:8000
        [--num-requests 100] [--floor-seconds 0.3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from dataclasses import asdict, dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx

from plugserve.bench import client as bench_client
from plugserve.bench.dataset import get_tokenizer, sample_random_prompts


@dataclass
class Sample:
    floor_before_ms: float
    floor_after_ms: float
    itl_p50_ms: float

    @property
    def stricter(self) -> float:
        return self.itl_p50_ms / min(self.floor_before_ms, self.floor_after_ms)

    def stable(self, tolerance: float) -> bool:
        low, high = sorted((self.floor_before_ms, self.floor_after_ms))
        return high <= low * (1 + tolerance)


async def floor_ms(client: httpx.AsyncClient, base_url: str, seconds: float) -> float:
    response = await client.get(f"{base_url}/bench/weight_read", params={"seconds": seconds})
    response.raise_for_status()
    return float(response.json()["floor_ms"])


async def measure(args: argparse.Namespace) -> list[Sample]:
    # The workload's requests exactly as `plugserve bench serve` sends them.
    workload = bench_client.parse_args(
        [
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
            "--temperature", "0",
            "--ignore-eos",
        ]
    )  # fmt: skip
    tokenizer = get_tokenizer(args.tokenizer)
    prompts = sample_random_prompts(tokenizer, args.num_requests, args.input_len, args.seed)
    model = bench_client.first_model_id(args.base_url)
    url = f"{args.base_url}/v1/completions"
    samples = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        for text, prompt_len in prompts:
            body = bench_client.request_body(workload, model, text)
            before = await floor_ms(client, args.base_url, args.floor_seconds)
            out = await bench_client.send_request(client, url, body, prompt_len, chat=False)
            after = await floor_ms(client, args.base_url, args.floor_seconds)
            if not out.success:
                raise SystemExit(f"request failed: {out.error}")
            samples.append(Sample(before, after, statistics.median(out.itl) * 1e3))
    return samples


def summarize(
    samples: list[Sample], tolerance: float, target: float, fast_floor_ms: float
) -> list[str]:
    lines = []
    stable = [s for s in samples if s.stable(tolerance)]
    groups = {
        f"floors within {tolerance:.0%} of each other": stable,
        "phase changed during the request": [s for s in samples if not s.stable(tolerance)],
    }

    def fast(s: Sample) -> bool:
        return min(s.floor_before_ms, s.floor_after_ms) < fast_floor_ms

    groups[f"stable, fast (floor < {fast_floor_ms} ms)"] = [s for s in stable if fast(s)]
    groups[f"stable, slow (floor >= {fast_floor_ms} ms)"] = [s for s in stable if not fast(s)]
    lines.append(
        f"{'requests':<40}{'n':>5}{'floor p50':>11}{'ITL p50':>9}"
        f"{'ITL/floor p50':>15}{'max':>7}{f'<= {target}x':>9}"
    )
    for name, group in groups.items():
        if not group:
            lines.append(f"{name:<40}{0:>5}")
            continue
        ratios = [s.stricter for s in group]
        floors = [min(s.floor_before_ms, s.floor_after_ms) for s in group]
        met = sum(r <= target for r in ratios)
        lines.append(
            f"{name:<40}{len(group):>5}{statistics.median(floors):>9.2f}ms"
            f"{statistics.median(s.itl_p50_ms for s in group):>7.2f}ms"
            f"{statistics.median(ratios):>15.2f}{max(ratios):>7.2f}{met:>5}/{len(group):<3}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--floor-seconds", type=float, default=0.3)
    parser.add_argument("--stable", type=float, default=0.10, help="floors this close: one phase")
    parser.add_argument("--target", type=float, default=1.5, help="ITL / floor to count as met")
    parser.add_argument(
        "--fast-floor-ms", type=float, default=4.5, help="floors below this: a fast phase"
    )
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None, help="write every sample here")
    args = parser.parse_args()
    samples = asyncio.run(measure(args))
    for line in summarize(samples, args.stable, args.target, args.fast_floor_ms):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(s) for s in samples], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
