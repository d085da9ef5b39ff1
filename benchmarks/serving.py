"""Online serving: `plugserve serve` per transport, driven by `plugserve bench serve`.

For each transport (zmq, shm; one not registered is skipped with a note) a server is
started on a free port, and the reference workload is run against it at each
concurrency: random prompts of exactly 128 tokens, 128 output tokens (EOS ignored),
temperature 0, streaming /v1/completions, every request sent at t=0 and capped by the
concurrency, one warm-up request, seed = the concurrency (as peers/bench.sh does with
`vllm bench serve`). 16 prompts at concurrency 1, 64 otherwise. The server runs in
bfloat16 with prefix caching off, as vLLM's CPU build is measured.

Each run also reads the engine's step counters from /metrics before and after: engine
overhead is step time minus forward-pass time (scheduling, batch updates, outputs), as a
share of step time. At the end: every run, then one line per transport in the layout of
the comparison table (docs/benchmarks.md), and with --peer-results (the JSON files the
peer scripts' bench.sh writes for `vllm bench serve`) the ratios against that peer.

    .venv/bin/python benchmarks/serving.py [--concurrency "1 8 32"] [--transports zmq]
        [--dtype bfloat16] [--server-args "--api-server-count 2"] [--json out.json]
        [--peer-results ~/.cache/plugserve-peers/results/vllm-both]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx

from plugserve import bench
from plugserve.bench.plugserve_server import PlugserveServer
from plugserve.bench.roofline import cpu_read_bandwidth, weight_bytes_per_step
from plugserve.bench.server_process import ServerError, ServerProcess
from plugserve.config import StackConfig
from plugserve.plugins import get_registry

TRANSPORTS = ("zmq", "shm")


def plugserve_server(transport: str, args: argparse.Namespace, log_dir: Path) -> PlugserveServer:
    """The server of a run: --max-num-seqs at least the highest concurrency, --dtype,
    then --server-args."""
    settings = ["--max-num-seqs", str(max(args.max_num_seqs, *args.concurrency))]
    if args.dtype:
        settings += ["--dtype", args.dtype]
    settings += shlex.split(args.server_args)
    return PlugserveServer(
        log_dir / f"server-{transport}.log", transport=transport, settings=settings
    )


@contextlib.contextmanager
def running_announced(
    server: ServerProcess, startup_timeout: float, *, check_exit: bool = True
) -> Iterator[ServerProcess]:
    """`server.running()`, printing its command and how long it took to be healthy."""
    print(f"$ {server.command_line()}  (log: {server.log_path})", flush=True)
    with server.running(check_exit=check_exit, startup_timeout=startup_timeout) as running:
        print(f"server healthy after {server.healthy_after:.1f} s", flush=True)
        yield running


def check_alive(server: ServerProcess) -> None:
    if server.popen.poll() is not None:
        raise ServerError("the server died during the run:\n" + server.log_tail())


def bench_args(args: argparse.Namespace, url: str, transport: str, conc: int) -> list[str]:
    num_prompts = args.num_prompts or (16 if conc == 1 else 64)
    return [
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(conc),
        "--request-rate",
        "inf",
        "--seed",
        str(conc),
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-warmups",
        "1",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--label",
        f"plugserve-{transport}",
    ]


STEP_COUNTERS = (
    "engine_steps_total",
    "engine_step_seconds_total",
    "engine_forward_seconds_total",
)


def step_counters(server: PlugserveServer) -> dict[str, float]:
    metrics = server.metrics()
    return {name: metrics[name] for name in STEP_COUNTERS if name in metrics}


def engine_overhead(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    steps, step_s, forward_s = (after.get(n, 0.0) - before.get(n, 0.0) for n in STEP_COUNTERS)
    if steps <= 0 or step_s <= 0:
        return {}
    return {
        "engine_steps": steps,
        "mean_step_ms": 1e3 * step_s / steps,
        "engine_overhead_pct": 100.0 * (step_s - forward_s) / step_s,
    }


def bandwidth_floor_ms(weight_bytes: int) -> float:
    """The bf16 floor of a batch-1 step at the read bandwidth right now (the server idle),
    since this VM's bandwidth drifts between minutes."""
    return weight_bytes / cpu_read_bandwidth() * 1e3


def engine_floor_ms(url: str) -> float | None:
    """The same floor measured by the engine on its own packed weights (GET
    /bench/weight_read): the rate at which this engine's buffer reads now. On this VM it
    can differ from a fresh buffer's by a third in the same second. None where the engine
    keeps no single weight buffer."""
    response = httpx.get(f"{url}/bench/weight_read", params={"seconds": 2.0}, timeout=60)
    return response.json()["floor_ms"] if response.status_code == 200 else None


def floors_ms(url: str, weight_bytes: int) -> dict[str, float]:
    """Every floor there is to measure now, by FLOORS key."""
    floors = {"floor_ms": bandwidth_floor_ms(weight_bytes)}
    engine = engine_floor_ms(url)
    if engine is not None:
        floors["engine_floor_ms"] = engine
    return floors


# The c=1 ITL's floors: (result key, what it is).
FLOORS = (
    ("floor_ms", "the bf16 bandwidth floor (weights / a fresh buffer's median read bandwidth)"),
    ("engine_floor_ms", "the floor on the engine's own weights"),
)


def run_transport(
    transport: str, args: argparse.Namespace, log_dir: Path, results: list[dict[str, Any]]
) -> None:
    """Each concurrency's result goes to `results` as soon as it is measured, so a server
    that then fails to stop cleanly still leaves its figures."""
    server = plugserve_server(transport, args, log_dir)
    weight_bytes = weight_bytes_per_step(StackConfig().model, dtype_bytes=2)
    with running_announced(server, args.startup_timeout):
        for conc in args.concurrency:
            print(f"\n=== transport={transport} concurrency={conc}", flush=True)
            bargs = bench.parse_args(bench_args(args, server.base_url, transport, conc))
            floors_before = floors_ms(server.base_url, weight_bytes) if conc == 1 else {}
            before = step_counters(server)
            result = bench.run_benchmark(bargs)
            if floors_before:
                floors_after = floors_ms(server.base_url, weight_bytes)
                for key in floors_before.keys() & floors_after.keys():
                    result[f"{key}_before"] = floors_before[key]
                    result[f"{key}_after"] = floors_after[key]
            result.update(engine_overhead(before, step_counters(server)))
            results.append({"transport": transport, "concurrency": conc, **result})
            check_alive(server)


def print_summary(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'transport':<10}{'conc':>5}{'prompts':>8}{'out tok/s':>11}"
        f"{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
        f"{'step ms':>9}{'eng ovh %':>10}{'failed':>7}"
    )
    print("\n" + header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['transport']:<10}{r['concurrency']:>5}{r['num_prompts']:>8}"
            f"{r['output_throughput']:>11.1f}{r['median_ttft_ms']:>10.1f}"
            f"{r['p99_ttft_ms']:>10.1f}{r['median_itl_ms']:>9.2f}{r['p99_itl_ms']:>9.2f}"
            f"{r.get('mean_step_ms', float('nan')):>9.2f}"
            f"{r.get('engine_overhead_pct', float('nan')):>10.2f}{r['failed']:>7}"
        )
    print("(latencies in ms; step ms and engine overhead from the engine's own counters)")
    for r in rows:
        for key, what in FLOORS:
            if f"{key}_before" not in r:
                continue
            before, after, itl = r[f"{key}_before"], r[f"{key}_after"], r["median_itl_ms"]
            floor = (before + after) / 2
            print(
                f"{r['transport']}: c=1 ITL p50 {itl:.2f} ms = {itl / floor:.2f}x {what}, "
                f"{floor:.2f} ms ({before:.2f} just before the run, {after:.2f} just after); "
                "target <= 1.5x"
            )


# The comparison table's columns (docs/benchmarks.md): (heading, concurrency, result key).
ISSUE_COLUMNS = (
    ("c=1 out tok/s", 1, "output_throughput"),
    ("c=1 TTFT p50", 1, "median_ttft_ms"),
    ("c=1 ITL p50", 1, "median_itl_ms"),
    ("c=8 out tok/s", 8, "output_throughput"),
    ("c=32 out tok/s", 32, "output_throughput"),
    ("c=32 ITL p50", 32, "median_itl_ms"),
    ("c=32 eng ovh %", 32, "engine_overhead_pct"),
)


def load_peer(prefix: Path) -> dict[int, dict[str, Any]]:
    """`vllm bench serve` results saved as <prefix>-c<C>.json (peers/bench.sh)."""
    runs = {}
    for conc in (1, 8, 32):
        path = prefix.parent / f"{prefix.name}-c{conc}.json"
        if path.is_file():
            runs[conc] = json.loads(path.read_text())
    return runs


def print_issue_table(rows: list[dict[str, Any]], peer: dict[int, dict[str, Any]], label: str):
    by_run = {(r["transport"], r["concurrency"]): r for r in rows}
    lines = {r["transport"]: {} for r in rows}
    if peer:
        lines = {label: {}, **lines}
    for system, cells in lines.items():
        for heading, conc, key in ISSUE_COLUMNS:
            run = peer.get(conc) if system == label else by_run.get((system, conc))
            value = run.get(key) if run else None
            cells[heading] = "—" if value is None else f"{value:.1f}"
    print("\n| system | " + " | ".join(h for h, _, _ in ISSUE_COLUMNS) + " |")
    print("|---" * (len(ISSUE_COLUMNS) + 1) + "|")
    for system, cells in lines.items():
        print(f"| {system} | " + " | ".join(cells.values()) + " |")
    if not peer:
        return
    print(f"\nratios against {label} (throughput: ours / theirs; latency: ours / theirs)")
    for transport in {r["transport"]: None for r in rows}:
        ratios = []
        for heading, conc, key in ISSUE_COLUMNS[:-1]:
            ours, theirs = by_run.get((transport, conc)), peer.get(conc)
            if ours and theirs and theirs.get(key):
                ratios.append(f"{heading} {ours[key] / theirs[key]:.2f}x")
        print(f"  {transport}: " + ", ".join(ratios))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", default=" ".join(TRANSPORTS), help='e.g. "zmq shm"')
    parser.add_argument("--concurrency", default="1 8 32", help='e.g. "1 8 32"')
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="default: 16 at concurrency 1, else 64"
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="at least the concurrency")
    parser.add_argument("--dtype", default="bfloat16", help="the server's --dtype")
    parser.add_argument(
        "--server-args",
        default="--enable-prefix-caching false",
        help="more `plugserve serve` settings",
    )
    parser.add_argument(
        "--peer-results",
        type=Path,
        default=Path.home() / ".cache/plugserve-peers/results/vllm-both",
        help="prefix of peers/bench.sh result files (<prefix>-c<C>.json); used if present",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="save every run's result here")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.replace(",", " ").split()]
    transports = args.transports.replace(",", " ").split()
    if not args.concurrency or not transports:
        parser.error("--concurrency and --transports need at least one value")

    registered = set(get_registry().implementations("transport"))
    print(
        f"transports={transports} concurrency={args.concurrency} input_len={args.input_len} "
        f"output_len={args.output_len} loadavg(1m)={os.getloadavg()[0]:.2f} "
        f"cores={os.cpu_count()}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    broken = False
    with tempfile.TemporaryDirectory(prefix="plugserve-bench-") as tmp:
        for transport in transports:
            if transport not in registered:
                note = (
                    f"skipped transport {transport!r}: not registered "
                    f"(registered: {', '.join(sorted(registered)) or 'none'})"
                )
                print(note, flush=True)
                notes.append(note)
                continue
            try:
                run_transport(transport, args, Path(tmp), rows)
            except RuntimeError as exc:
                note = f"transport {transport!r} failed: {exc}"
                print(note, file=sys.stderr, flush=True)
                notes.append(note.splitlines()[0])
                broken = True
    if rows:
        print_summary(rows)
        peer = load_peer(args.peer_results)
        print_issue_table(rows, peer, f"peer: {args.peer_results.name}")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "notes": notes}
        report["runs"] = rows
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"saved {args.json}")
    broken = broken or not rows or any(r["failed"] for r in rows)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
