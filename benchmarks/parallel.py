"""Tensor and data parallelism on this machine, in one run: the serving workload at one
concurrency against `plugserve serve` with one engine (TP=1, DP=1), with the mp executor
at TP=2, and with two data-parallel engines (DP=2). Ratios against the first row.

    .venv/bin/python benchmarks/parallel.py [--concurrency 32] [--transport zmq]

`--pipeline`: pipeline parallelism's stage overlap instead, in process (the engine's own
counters): c requests generated at once on the mp executor with one stage of all the
threads (PP=1) and with two stages of half the threads each (PP=2), on the same cores;
per run the output tok/s and, for PP=2, each stage's busy share of the wall time (its
seconds of work, carried back with every batch: SchedulerStats.pipeline_stage_busy_seconds).

    .venv/bin/python benchmarks/parallel.py --pipeline [--concurrency 8] [--output-len 64]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from serving import bench_args, plugserve_server, running_announced  # the sibling benchmark

from plugserve import bench

CONFIGS = {
    "TP=1 DP=1 (uni)": "",
    "TP=2 (mp)": "--stack.executor mp --tensor-parallel-size 2",
    "DP=2": "--data-parallel-size 2",
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def pipeline_run(stages: int, args: argparse.Namespace) -> dict[str, object]:
    """One engine with `stages` pipeline stages sharing this machine's cores evenly."""
    from plugserve import LLM, SamplingParams

    cores = len(os.sched_getaffinity(0))
    llm = LLM(
        executor="mp",
        pipeline_parallel_size=stages,
        num_threads=max(1, cores // stages),
        max_num_seqs=max(8, args.concurrency),
        kv_cache_memory="256MiB",
        **({"dtype": args.dtype} if args.dtype else {}),
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        prompt = {"prompt_token_ids": list(range(1000, 1000 + args.input_len))}
        llm.generate([prompt] * args.concurrency, params)  # warm-up
        before = llm.engine.stats().pipeline_stage_busy_seconds
        started = time.perf_counter()
        outputs = llm.generate([prompt] * args.concurrency, params)
        wall = time.perf_counter() - started
        after = llm.engine.stats().pipeline_stage_busy_seconds
    finally:
        llm.engine.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    busy = [(b - a) / wall for a, b in zip(before or [0.0] * len(after), after, strict=True)]
    return {"tok_s": tokens / wall, "busy": busy, "wall": wall}


def pipeline_main(args: argparse.Namespace) -> int:
    rows = {stages: pipeline_run(stages, args) for stages in (1, 2)}
    print(
        f"\nCPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores; c={args.concurrency}, "
        f"{args.input_len} prompt + {args.output_len} output tokens each"
    )
    print(f"{'stages':<8}{'out tok/s':>11}{'vs PP=1':>9}  busy share per stage")
    base = float(rows[1]["tok_s"])  # type: ignore[arg-type]
    for stages, row in rows.items():
        tok_s = float(row["tok_s"])  # type: ignore[arg-type]
        busy = ", ".join(f"{share:.0%}" for share in row["busy"]) or "-"  # type: ignore[union-attr]
        print(f"PP={stages:<5}{tok_s:>11.1f}{tok_s / base:>8.2f}x  {busy}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", action="store_true", help="pipeline stages' overlap")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--transport", default="zmq")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.pipeline:
        args.concurrency = args.concurrency or 8
        args.output_len = min(args.output_len, 64)
        return pipeline_main(args)
    args.concurrency = args.concurrency or 32
    rows = []
    with tempfile.TemporaryDirectory(prefix="plugserve-parallel-") as tmp:
        for label, server_args in CONFIGS.items():
            run_args = argparse.Namespace(
                max_num_seqs=args.concurrency,
                concurrency=[args.concurrency],
                dtype=args.dtype,
                server_args=server_args,
                num_prompts=args.num_prompts,
                input_len=args.input_len,
                output_len=args.output_len,
            )
            server = plugserve_server(args.transport, run_args, Path(tmp))
            with running_announced(server, args.startup_timeout):
                print(f"\n=== {label}", flush=True)
                parsed = bench.parse_args(
                    bench_args(run_args, server.base_url, args.transport, args.concurrency)
                )
                rows.append((label, bench.run_benchmark(parsed)))
    base = rows[0][1]["output_throughput"]
    print(
        f"\n{'configuration':<18}{'out tok/s':>11}{'vs TP=1 DP=1':>14}{'ITL p50 ms':>12}{'failed':>8}"
    )
    for label, r in rows:
        print(
            f"{label:<18}{r['output_throughput']:>11.1f}{r['output_throughput'] / base:>13.2f}x"
            f"{r['median_itl_ms']:>12.1f}{r['failed']:>8}"
        )
    return 1 if any(r["failed"] for _, r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
