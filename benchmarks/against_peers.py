"""plugserve against its peers: the whole comparison table in one go.

One server at a time (the machine's cores are shared by nothing else): plugserve
(`plugserve serve --dtype bfloat16 --enable-prefix-caching false`), the same in int8
(`--stack.linear_method int8`: W8A8), vLLM's CPU build
(the peer scripts' run_vllm.sh, its OpenMP threads bound to every core, none reserved) and
llama.cpp's llama-server (run_llamaserver.sh; skipped with a note when it is not built).
Every server is driven by the same client, vLLM's own (bench.sh: `vllm bench serve`, seed
= the concurrency), on two workloads:

- reference: random 128-token prompts, 128 output tokens, EOS ignored, at c=1 (16
  prompts), 8 and 32 (64 prompts): output tok/s; at c=1 also TTFT p50 and ITL p50;
- long: random 1024-token prompts, 16 output tokens, at c=1 (TTFT p50) and c=8 (prefill
  input tok/s = input tokens / duration, and TTFT p50).

It prints the CPU (model, AMX or not), the read bandwidth (plugserve.bench.roofline,
measured with no server running before each server and after the last) and the
bandwidth floor of a batch-1 bf16 step, the table (runs side by side, A / B / ...), and
the acceptance criteria (docs/benchmarks.md): plugserve against vLLM and the floor, its
int8 rows against its bf16 and llama-server's Q4_1; each marked pass or fail per run.

    .venv/bin/python benchmarks/against_peers.py [--runs 2] [--gap-minutes 20]
        [--skip llamaserver] [--concurrency "1 8 32"] [--long-concurrency "1 8"]
        [--plugserve-args "--dtype bfloat16 --enable-prefix-caching false"]
        [--json out.json]

The peer scripts are not part of this repository: --peers-dir names their folder
(default: shared/peers beside the checkout), set up once (setup_model.sh, setup_vllm.sh;
setup_llamaserver.sh for llama-server); $ANCHORS (default ~/.cache/plugserve-peers) is
where they install the peers and keep results. docs/benchmarks.md says what each does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import socket
import string
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from serving import check_alive, plugserve_server, running_announced  # the sibling benchmark

from plugserve.bench.server_process import ServerProcess, free_port

SYSTEMS = ("plugserve", "plugserve_int8", "vllm", "llamaserver")
SHOWN = {
    "plugserve": "plugserve",
    "plugserve_int8": "plugserve int8 (W8A8)",
    "vllm": "vLLM CPU",
    "llamaserver": "llama.cpp llama-server",
}
# plugserve's int8 rows: the same server with every linear and the LM head in W8A8
INT8_ARGS = "--stack.linear_method int8"
DEFAULT_PORTS = {"vllm": 8102, "llamaserver": 8103}  # the peers scripts' own
# workload -> (input tokens, output tokens)
WORKLOADS = {"ref": (128, 128), "long": (1024, 16)}
MAX_MODEL_LEN = 2048  # per sequence, as run_vllm.sh and plugserve's default
ANCHORS = Path(os.environ.get("ANCHORS", Path.home() / ".cache/plugserve-peers"))
PEERS_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "peers"


# -- the table and the acceptance criteria (pure: no servers) ---------------------------


def columns(ref_concs: list[int], long_concs: list[int]) -> list[tuple[str, str, int, str]]:
    """The table's columns as (heading, workload, concurrency, result key)."""
    cols = []
    for c in ref_concs:
        cols.append((f"c={c} tok/s", "ref", c, "output_throughput"))
        if c == 1:
            cols.append(("c=1 TTFT p50 ms", "ref", 1, "median_ttft_ms"))
            cols.append(("c=1 ITL p50 ms", "ref", 1, "median_itl_ms"))
    for c in long_concs:
        if c != 1:
            cols.append((f"long c={c} prefill tok/s", "long", c, "prefill_throughput"))
        cols.append((f"long c={c} TTFT p50 ms", "long", c, "median_ttft_ms"))
    return cols


@dataclass(frozen=True)
class Criterion:
    """`system`'s figure at (workload, concurrency, key) against `reference`'s (a system,
    or "floor": the bandwidth floor of a batch-1 bf16 step), `op` `threshold` times it."""

    name: str
    workload: str
    concurrency: int
    key: str
    reference: str
    op: str
    threshold: float
    system: str = "plugserve"


CRITERIA = (
    Criterion("c=8 out tok/s >= 1.25x vLLM", "ref", 8, "output_throughput", "vllm", ">=", 1.25),
    Criterion("c=32 out tok/s >= 1.25x vLLM", "ref", 32, "output_throughput", "vllm", ">=", 1.25),
    Criterion("c=1 TTFT p50 <= vLLM", "ref", 1, "median_ttft_ms", "vllm", "<=", 1.0),
    Criterion("c=1 ITL p50 <= 1.5x bandwidth floor", "ref", 1, "median_itl_ms", "floor", "<=", 1.5),
    Criterion(
        "1024-token prompts: c=8 prefill tok/s >= 1.2x vLLM",
        "long",
        8,
        "prefill_throughput",
        "vllm",
        ">=",
        1.2,
    ),
    Criterion(
        "1024-token prompts: c=1 TTFT p50 <= 0.9x vLLM",
        "long",
        1,
        "median_ttft_ms",
        "vllm",
        "<=",
        0.9,
    ),
    Criterion(
        "int8: c=1 ITL p50 <= 0.6x bf16's",
        "ref",
        1,
        "median_itl_ms",
        "plugserve",
        "<=",
        0.6,
        system="plugserve_int8",
    ),
    Criterion(
        "int8: c=1 ITL p50 < llama-server Q4_1's",
        "ref",
        1,
        "median_itl_ms",
        "llamaserver",
        "<",
        1.0,
        system="plugserve_int8",
    ),
)


def lookup(results: list[dict[str, Any]], run: int, system: str, workload: str, conc: int):
    for r in results:
        if (r["run"], r["system"], r["workload"], r["concurrency"]) == (
            run,
            system,
            workload,
            conc,
        ):
            return r
    return None


def _holds(ratio: float, op: str, threshold: float) -> bool:
    return {">=": ratio >= threshold, "<=": ratio <= threshold, "<": ratio < threshold}[op]


def acceptance(
    results: list[dict[str, Any]], run: int, floor_ms: float | None
) -> list[dict[str, Any]]:
    """Each criterion for one run: the system's value, the reference's (a peer's, bf16's,
    or the bandwidth floor), their ratio, and passed (None where either side is missing)."""
    checks = []
    for c in CRITERIA:
        ours = lookup(results, run, c.system, c.workload, c.concurrency)
        ours_value = ours.get(c.key) if ours else None
        if c.reference == "floor":
            theirs_value = floor_ms
        else:
            theirs = lookup(results, run, c.reference, c.workload, c.concurrency)
            theirs_value = theirs.get(c.key) if theirs else None
        ratio = passed = None
        if ours_value is not None and theirs_value:
            ratio = ours_value / theirs_value
            passed = _holds(ratio, c.op, c.threshold)
        checks.append(
            {
                "run": run,
                "criterion": c.name,
                "system": c.system,
                "value": ours_value,
                "reference": c.reference,
                "reference_value": theirs_value,
                "ratio": ratio,
                "target": f"{c.op} {c.threshold:g}x",
                "passed": passed,
            }
        )
    return checks


def fmt(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"


def markdown_table(
    results: list[dict[str, Any]], runs: list[int], cols: list[tuple[str, str, int, str]]
) -> str:
    """One row per system, each cell its runs' values side by side (A / B / ...)."""
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in results)]
    lines = [
        "| system | " + " | ".join(h for h, _, _, _ in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for system in systems:
        cells = []
        for _, workload, conc, key in cols:
            values = []
            for run in runs:
                r = lookup(results, run, system, workload, conc)
                values.append(fmt(r.get(key) if r else None))
            cells.append(" / ".join(values))
        lines.append(f"| {SHOWN[system]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_acceptance(checks: list[dict[str, Any]]) -> str:
    lines = [
        "| run | criterion | value | reference | ratio | target | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        reference = "bandwidth floor" if c["reference"] == "floor" else SHOWN[c["reference"]]
        result = {True: "**pass**", False: "**FAIL**", None: "n/a"}[c["passed"]]
        ratio = "—" if c["ratio"] is None else f"{c['ratio']:.2f}x"
        lines.append(
            f"| {run_name(c['run'])} | {c['criterion']} | {fmt(c['value'])} | "
            f"{reference} {fmt(c['reference_value'])} | {ratio} | {c['target']} | {result} |"
        )
    return "\n".join(lines)


def run_name(run: int) -> str:
    return string.ascii_uppercase[run] if run < 26 else str(run + 1)


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The figures kept from one `vllm bench serve` result JSON."""
    keys = (
        "completed",
        "failed",
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "output_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "median_tpot_ms",
    )
    out = {k: raw.get(k) for k in keys}
    if raw.get("duration"):
        out["prefill_throughput"] = raw["total_input_tokens"] / raw["duration"]
    return out


# -- the machine ------------------------------------------------------------------------


def cpu_info() -> dict[str, Any]:
    model = None
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "model": model,
        "cores": os.cpu_count(),
        "amx": sorted(f for f in flags if f.startswith("amx")),
        "avx512_bf16": "avx512_bf16" in flags,
        "avx512f": "avx512f" in flags,
    }


def versions() -> dict[str, str]:
    """The peers' versions: vLLM's from its venv's dist-info, llama-server's own."""
    found = {}
    for dist in (ANCHORS / "venv-vllm").glob("lib/python*/site-packages/vllm-*.dist-info"):
        found["vllm"] = dist.name.removeprefix("vllm-").removesuffix(".dist-info")
    binary = ANCHORS / "llama-server/bin/llama-server"
    if binary.is_file():
        try:
            out = subprocess.run(
                [str(binary), "--version"], capture_output=True, text=True, timeout=30
            )
            lines = (out.stdout + out.stderr).strip().splitlines()
            found["llamaserver"] = next((x for x in lines if x.startswith("version")), lines[-1])
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    return found


def measure_bandwidth() -> float:
    from plugserve.bench.roofline import cpu_read_bandwidth

    return cpu_read_bandwidth()


# -- servers and the client -------------------------------------------------------------


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def peer_server(name: str, script: Path, env: dict[str, str], log_dir: Path) -> ServerProcess:
    """A peers script (run_vllm.sh, run_llamaserver.sh) on its usual port if free. SIGINT
    stops it: the script execs the server, which takes it as Ctrl-C."""
    default = DEFAULT_PORTS[name]
    port = default if port_free(default) else free_port()
    return ServerProcess(
        ["bash", str(script)],
        port=port,
        log_path=log_dir / f"server-{name}.log",
        env={"ANCHORS": str(ANCHORS), "PORT": str(port), **env},
        stop_signal=signal.SIGINT,
        poll_interval=1.0,
    )


def make_server(system: str, args: argparse.Namespace, log_dir: Path) -> ServerProcess:
    if system in ("plugserve", "plugserve_int8"):
        from plugserve.config import StackConfig

        int8 = system == "plugserve_int8"
        ns = argparse.Namespace(
            max_num_seqs=64,  # plugserve's default, and run_vllm.sh's
            concurrency=args.concurrency + args.long_concurrency,
            dtype=None,
            server_args=f"{args.plugserve_args} {INT8_ARGS}" if int8 else args.plugserve_args,
        )
        server_log_dir = log_dir / "int8" if int8 else log_dir
        server_log_dir.mkdir(exist_ok=True)
        return plugserve_server(StackConfig().stack.transport, ns, server_log_dir)
    cores = os.cpu_count() or 1
    if system == "vllm":
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}
        return peer_server(system, args.peers_dir / "run_vllm.sh", env, log_dir)
    slots = max(32, *args.concurrency, *args.long_concurrency)
    env = {"NP": str(slots), "CTX": str(slots * MAX_MODEL_LEN)}
    return peer_server(system, args.peers_dir / "run_llamaserver.sh", env, log_dir)


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30.0).json()["data"][0]["id"]


def run_bench(
    args: argparse.Namespace, system: str, url: str, workload: str, conc: int, out_dir: Path
) -> dict[str, Any]:
    """bench.sh at one concurrency; its input/output lengths and result folder are set
    through BENCH_EXTRA_ARGS (`vllm bench serve` keeps the last value of a flag)."""
    input_len, output_len = WORKLOADS[workload]
    label = f"{system}-{workload}"
    path = out_dir / f"{label}-c{conc}.json"
    path.unlink(missing_ok=True)
    extra = ["--input-len", str(input_len), "--output-len", str(output_len)]
    extra += ["--result-dir", str(out_dir)]
    env = {
        **os.environ,
        "ANCHORS": str(ANCHORS),
        "MODEL_NAME": served_model(url),
        "SEED": str(conc),
    }
    env.update(N=str(args.num_prompts), N_FOR_C1=str(args.num_prompts_c1))
    env.pop("EXTRA_BODY", None)
    if system == "llamaserver":
        # its keep-alive drops reused connections; its prompt cache would skew repeats
        extra += ["--header", "Connection=close"]
        env["EXTRA_BODY"] = json.dumps({"cache_prompt": False})
    env["BENCH_EXTRA_ARGS"] = " ".join(extra)
    cmd = ["bash", str(args.peers_dir / "bench.sh"), label, url, str(conc)]
    print(
        f"\n$ BENCH_EXTRA_ARGS={shlex.quote(env['BENCH_EXTRA_ARGS'])} {shlex.join(cmd)}", flush=True
    )
    subprocess.run(cmd, env=env, check=False)
    if not path.is_file():
        raise RuntimeError(f"bench.sh wrote no {path} (run the command above by hand to see why)")
    return {**summarize(json.loads(path.read_text())), "result_file": str(path)}


def run_system(
    system: str, run: int, args: argparse.Namespace, out_dir: Path, results: list[dict[str, Any]]
) -> None:
    """Each level's result goes to `results` as soon as it is measured, so a server that
    then fails to stop cleanly still leaves its figures. Only plugserve's exit status is
    held to 0: the peers' is theirs."""
    server = make_server(system, args, out_dir)
    ours = system.startswith("plugserve")
    with running_announced(server, args.startup_timeout, check_exit=ours):
        for workload, concs in (("ref", args.concurrency), ("long", args.long_concurrency)):
            for conc in concs:
                input_len, output_len = WORKLOADS[workload]
                result = run_bench(args, system, server.base_url, workload, conc, out_dir)
                results.append(
                    {
                        "run": run,
                        "system": system,
                        "workload": workload,
                        "concurrency": conc,
                        "input_len": input_len,
                        "output_len": output_len,
                        **result,
                    }
                )
                check_alive(server)


# -- main -------------------------------------------------------------------------------


def parse_concs(text: str) -> list[int]:
    return [int(c) for c in text.replace(",", " ").split()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="repeat the whole table")
    parser.add_argument("--gap-minutes", type=float, default=0.0, help="pause between runs")
    parser.add_argument("--skip", default="", help='systems to leave out, e.g. "llamaserver"')
    parser.add_argument("--concurrency", default="1 8 32", help="reference workload's levels")
    parser.add_argument("--long-concurrency", default="1 8", help='1024-token prompts; "" skips')
    parser.add_argument("--num-prompts", type=int, default=64, help="per level above 1")
    parser.add_argument("--num-prompts-c1", type=int, default=16, help="at concurrency 1")
    parser.add_argument(
        "--plugserve-args",
        default="--dtype bfloat16 --enable-prefix-caching false",
        help="`plugserve serve` settings",
    )
    parser.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="where vllm bench's JSONs and the servers' logs go "
        "(default: $ANCHORS/results/against_peers-<time>)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="save the whole report here")
    args = parser.parse_args()
    args.concurrency = parse_concs(args.concurrency)
    args.long_concurrency = parse_concs(args.long_concurrency)
    skip = set(args.skip.replace(",", " ").split())
    if skip - set(SYSTEMS):
        parser.error(f"--skip takes {', '.join(SYSTEMS)}")
    systems = [s for s in SYSTEMS if s not in skip]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    results_dir = args.results_dir or ANCHORS / "results" / f"against_peers-{stamp}"
    if " " in str(results_dir):
        parser.error("the results folder's path must have no spaces (bench.sh splits its flags)")
    if not (ANCHORS / "venv-vllm" / "bin" / "vllm").is_file():
        parser.error(f"no vLLM client in {ANCHORS}/venv-vllm: run {args.peers_dir}/setup_vllm.sh")
    notes: list[str] = []
    broken = False
    if "llamaserver" in systems and not (ANCHORS / "llama-server/bin/llama-server").is_file():
        systems.remove("llamaserver")
        notes.append(f"llama-server skipped: not built (run {args.peers_dir}/setup_llamaserver.sh)")
        print("note: " + notes[-1], flush=True)

    from plugserve.bench.roofline import weight_bytes_per_step
    from plugserve.config import StackConfig

    cpu = cpu_info()
    peer_versions = versions()
    weight_bytes = weight_bytes_per_step(StackConfig().model, dtype_bytes=2)
    print(f"CPU: {cpu}; bf16 weights per batch-1 step: {weight_bytes / 1e6:.1f} MB", flush=True)
    results: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for run in range(args.runs):
        if run and args.gap_minutes:
            print(f"\nwaiting {args.gap_minutes:g} min before run {run_name(run)}", flush=True)
            time.sleep(60 * args.gap_minutes)
        out_dir = results_dir / f"run-{run_name(run)}"
        out_dir.mkdir(parents=True, exist_ok=True)
        info = {"run": run, "started": datetime.datetime.now().isoformat(timespec="seconds")}
        info["bandwidth_gb_s"] = []
        for system in systems:
            info["bandwidth_gb_s"].append(round(measure_bandwidth() / 1e9, 2))
            print(f"\n##### run {run_name(run)}: {system}", flush=True)
            try:
                run_system(system, run, args, out_dir, results)
            except RuntimeError as exc:
                note = f"run {run_name(run)}: {system} failed: {exc}"
                print(note, file=sys.stderr, flush=True)
                notes.append(note.splitlines()[0])
                broken = True
        info["bandwidth_gb_s"].append(round(measure_bandwidth() / 1e9, 2))
        bandwidth = sum(info["bandwidth_gb_s"]) / len(info["bandwidth_gb_s"]) * 1e9
        info["floor_ms"] = weight_bytes / bandwidth * 1e3
        runs.append(info)

    failed = [r for r in results if r.get("failed")]
    for r in failed:
        notes.append(f"{r['system']} {r['workload']} c={r['concurrency']}: {r['failed']} failed")
    checks = [c for info in runs for c in acceptance(results, info["run"], info["floor_ms"])]
    cols = columns(args.concurrency, args.long_concurrency)
    names = " / ".join(run_name(i["run"]) for i in runs)
    amx = " ".join(cpu["amx"]) if cpu["amx"] else "no AMX"
    print(f"\n## plugserve against its peers (runs {names})\n")
    print(f"- CPU: {cpu['model']}, {cpu['cores']} cores; {amx}; AVX512_BF16: {cpu['avx512_bf16']}")
    for system, version in peer_versions.items():
        print(f"- {SHOWN[system]}: {version}")
    for info in runs:
        bws = ", ".join(f"{b:.1f}" for b in info["bandwidth_gb_s"])
        print(
            f"- run {run_name(info['run'])} ({info['started']}): read bandwidth {bws} GB/s "
            f"(before each server, after the last); floor of a batch-1 step "
            f"{weight_bytes / 1e6:.1f} MB / mean = {info['floor_ms']:.2f} ms"
        )
    print(
        "- workloads: reference 128-token random prompts, 128 output tokens; long 1024-token "
        "prompts, 16 output tokens; vLLM's client; latencies in ms\n"
    )
    print(markdown_table(results, [i["run"] for i in runs], cols))
    print("\n### Acceptance: plugserve against vLLM, llama-server and its own bf16\n")
    print(markdown_acceptance(checks))
    for note in notes:
        print(f"\nnote: {note}")
    print(f"\nvllm bench results and server logs: {results_dir}")
    if args.json:
        report = {
            "cpu": cpu,
            "weight_bytes_per_step": weight_bytes,
            "args": {k: str(v) for k, v in vars(args).items()},
            "systems": systems,
            "versions": peer_versions,
            "runs": runs,
            "results": results,
            "acceptance": checks,
            "notes": notes,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"saved {args.json}")
    return 1 if broken or failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
