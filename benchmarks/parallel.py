"""Tensor and data parallelism on this machine, in one run: the serving workload at one
concurrency against `plugserve serve` with one engine (TP=1, DP=1), with the mp executor
at TP=2, and with two data-parallel engines (DP=2). Ratios against the first row.

    .venv/bin/python benchmarks/parallel.py [--concurrency 32] [--transport zmq]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from serving import bench_args, plugserve_server, running_announced  # the sibling benchmark

from plugserve import bench

CONFIGS = {
    "TP=1 DP=1 (uni)": "",
    "TP=2 (mp)": "--stack.executor mp --tensor-parallel-size 2",
    "DP=2": "--data-parallel-size 2",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--transport", default="zmq")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args()
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
