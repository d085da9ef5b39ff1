"""Structured output's cost: serving throughput with every request under a JSON schema,
against the same run without grammars, on one server in the same minutes.

The workload is serving.py's (random 128-token prompts, 128 output tokens, EOS ignored,
temperature 0, streaming /v1/completions, every request at t=0 capped by the
concurrency), at c=8 and c=32. The constrained runs add vLLM's `structured_outputs`
extra with SCHEMA, which cannot be complete within 128 tokens (at least 64 strings in a
list), so every request runs to the same length in both runs and output tokens per
second compare like for like; the mean output length is printed to show it.

From the engine's counters on /metrics (plugserve_grammar_*), each constrained run also
reports the bitmask time per step that built one, and the share of those steps in which
the forward pass was still running when the bitmask was done (it hid the bitmask).

    .venv/bin/python benchmarks/structured_output.py [--concurrency "8 32"]
        [--backend xgrammar] [--dtype bfloat16] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from serving import bench_args, plugserve_server, running_announced

from plugserve import bench
from plugserve.bench.plugserve_server import PlugserveServer

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 64},
    },
    "required": ["title", "tags"],
}
GRAMMAR_COUNTERS = (
    "grammar_bitmask_steps_total",
    "grammar_bitmask_seconds_total",
    "grammar_bitmask_hidden_steps_total",
    "engine_steps_total",
)


def counters(server: PlugserveServer) -> dict[str, float]:
    metrics = server.metrics()
    return {name: metrics[name] for name in GRAMMAR_COUNTERS if name in metrics}


def run(
    server: PlugserveServer, args: argparse.Namespace, conc: int, constrained: bool
) -> dict[str, Any]:
    argv = bench_args(args, server.base_url, args.transport, conc)
    if constrained:
        argv += ["--extra-body", json.dumps({"structured_outputs": {"json": SCHEMA}})]
    before = counters(server)
    result = bench.run_benchmark(bench.parse_args(argv))
    after = counters(server)
    delta = {n: after.get(n, 0.0) - before.get(n, 0.0) for n in GRAMMAR_COUNTERS}
    row = {
        "concurrency": conc,
        "constrained": constrained,
        "output_throughput": result["output_throughput"],
        "mean_output_tokens": result["total_output_tokens"] / max(result["completed"], 1),
        "completed": result["completed"],
    }
    if constrained:
        steps = delta["grammar_bitmask_steps_total"]
        row["bitmask_steps_share"] = steps / max(delta["engine_steps_total"], 1)
        row["bitmask_ms_per_step"] = (
            1e3 * delta["grammar_bitmask_seconds_total"] / steps if steps else 0.0
        )
        row["bitmask_hidden_share"] = (
            delta["grammar_bitmask_hidden_steps_total"] / steps if steps else 0.0
        )
    return row


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median output throughput."""
    ordered = sorted(runs, key=lambda r: r["output_throughput"])
    return ordered[len(ordered) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="8 32")
    parser.add_argument("--backend", default="xgrammar", help="stack.structured_output")
    parser.add_argument("--transport", default="zmq")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--server-args", default="--enable-prefix-caching false")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="alternating runs of each kind per concurrency; medians are compared",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split()]
    args.server_args += f" --stack.structured_output {args.backend}"
    args.server_args += f" --stack.transport {args.transport}"

    rows = []
    with tempfile.TemporaryDirectory(prefix="plugserve-bench-so-") as log_dir:
        server = plugserve_server(args.transport, args, Path(log_dir))
        with running_announced(server, startup_timeout=600):
            for conc in args.concurrency:
                # Alternating, so drift of this VM's speed between minutes hits both kinds.
                for _ in range(args.repeats):
                    for constrained in (False, True):
                        rows.append(run(server, args, conc, constrained))
                        print(json.dumps(rows[-1]), flush=True)

    print(
        f"\nstructured output ({args.backend}), {args.dtype}, output tok/s "
        f"(median of {args.repeats} alternating runs):"
    )
    print(
        "| c | no grammar | JSON schema | ratio | mean output tokens | bitmask ms/step "
        "| hidden by forward |"
    )
    print("|---|---|---|---|---|---|---|")
    for conc in args.concurrency:
        plain, json_row = (
            median_row([r for r in rows if r["concurrency"] == conc and r["constrained"] == kind])
            for kind in (False, True)
        )
        ratio = json_row["output_throughput"] / plain["output_throughput"]
        print(
            f"| {conc} | {plain['output_throughput']:.1f} | {json_row['output_throughput']:.1f} "
            f"| {ratio:.2f} | {plain['mean_output_tokens']:.0f} / "
            f"{json_row['mean_output_tokens']:.0f} | {json_row['bitmask_ms_per_step']:.2f} "
            f"| {100 * json_row['bitmask_hidden_share']:.0f} % |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
