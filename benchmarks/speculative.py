"""Speculative decoding served: the built-in SmolLM2 in bfloat16 without and with
`stack.speculative`, at each concurrency, on two workloads:

- copy-heavy: benchmarks/data/copy_heavy.jsonl (made by make_copy_heavy.py there: repeat
  a text with a name changed or a typo fixed, rename a variable in a function), chat,
  temperature 0, up to 128 tokens each (the model may stop earlier; greedy output is the
  same with and without speculation, so both runs produce the same tokens);
- random: vLLM's random workload, 128 random prompt tokens, 128 output tokens with EOS
  ignored, temperature 0 (little to copy: what speculation costs when it has nothing to
  propose).

With llama.cpp's llama-server built in $ANCHORS (../shared/peers/setup_llamaserver.sh),
a third server runs the copy-heavy workload: the Q4_1 GGUF, plain (the yardstick for a
per-token time at c=1), its prompt cache off, one connection per request. (Its
/v1/completions answers the random workload's prompts with at most one token here, so
that workload has no llama-server column.)

Per run: output tokens/s, median time per output token and median inter-token latency,
then the speculative server's acceptance from /metrics (vLLM's spec_decode counters): the
share of draft tokens accepted, the mean tokens landed per verified draft, and the rate
at each draft position. The ratios speculative / plain compare runs on the same machine,
one right after the other (servers are started in turn, never together).

    .venv/bin/python benchmarks/speculative.py [--concurrency "1 8"] [--proposer ngram]
        [--num-tokens 4] [--rounds 2] [--workloads "copy-heavy random"] [--json out.json]
        [--skip-llamaserver] [--peers-dir ../shared/peers]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx
from against_peers import ANCHORS, PEERS_DIR, peer_server  # the sibling benchmark

from plugserve.bench.client import send_request
from plugserve.bench.dataset import EMBEDDED_MODEL, get_tokenizer, sample_random_prompts
from plugserve.bench.metrics import RequestOutput
from plugserve.bench.plugserve_server import PlugserveServer
from plugserve.bench.server_process import ServerProcess

COPY_HEAVY = Path(__file__).parent / "data" / "copy_heavy.jsonl"
RANDOM_LEN = 128
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def workloads(num_random: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    """Request bodies (without model and stream options) of each workload."""
    copy_heavy = [
        {"messages": r["messages"], "max_tokens": r["max_tokens"], "temperature": 0.0}
        for r in map(json.loads, COPY_HEAVY.read_text().splitlines())
    ]
    tokenizer = get_tokenizer(EMBEDDED_MODEL)
    random = [
        {"prompt": text, "max_tokens": RANDOM_LEN, "temperature": 0.0, "ignore_eos": True}
        for text, _ in sample_random_prompts(tokenizer, num_random, RANDOM_LEN, seed)
    ]
    return {"copy-heavy": copy_heavy, "random": random}


async def run_workload(
    server: ServerProcess, bodies: list[dict[str, Any]], concurrency: int, peer: bool = False
) -> tuple[list[RequestOutput], float]:
    """`peer`: llama-server, whose keep-alive drops reused connections and whose prompt
    cache would skew repeated prompts: a connection per request, the cache off."""
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0 if peer else None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(3600)) as client:

        async def one(body: dict[str, Any]) -> RequestOutput:
            chat = "messages" in body
            path = "/v1/chat/completions" if chat else "/v1/completions"
            full = {
                **body,
                "model": LLAMASERVER_MODEL if peer else EMBEDDED_MODEL,
                "stream": True,
                "stream_options": {"include_usage": True},
                **({"cache_prompt": False} if peer else {}),
            }
            async with semaphore:
                return await send_request(client, server.base_url + path, full, 0, chat)

        await one(bodies[0])  # warm-up
        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(b) for b in bodies))
        return list(outputs), time.perf_counter() - start


def summarize(outputs: list[RequestOutput], duration: float) -> dict[str, float]:
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    tokens = sum(o.output_tokens for o in outputs)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in outputs if o.output_tokens > 1]
    itls = [gap for o in outputs for gap in o.itl]
    return {
        "output_tokens": tokens,
        "output_throughput": tokens / duration,
        "median_tpot_ms": 1000 * statistics.median(tpots),
        "median_itl_ms": 1000 * statistics.median(itls) if itls else 0.0,
    }


def spec_counters(server: PlugserveServer) -> dict[str, float]:
    values = server.metrics()
    found: dict[str, float] = {}
    for name, value in values.items():
        base = name.partition("{")[0]
        if base.startswith("vllm:spec_decode_") and base.endswith("_total"):
            key = base.removeprefix("vllm:spec_decode_").removesuffix("_total")
            if key == "num_accepted_tokens_per_pos":
                position = name.split('position="')[1].split('"')[0]
                key = f"pos{position}"
            found[key] = found.get(key, 0.0) + value
    return found


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = delta.get("num_drafts", 0.0)
    if not drafts:
        return {"drafts": 0}
    positions = sorted((k for k in delta if k.startswith("pos")), key=lambda k: int(k[3:]))
    return {
        "drafts": int(drafts),
        "acceptance_rate": delta["num_accepted_tokens"] / delta["num_draft_tokens"],
        "mean_accepted_length": 1 + delta["num_accepted_tokens"] / drafts,
        "per_position": [round(delta[k] / drafts, 3) for k in positions],
    }


def serve(label: str, settings: list[str], log_dir: Path) -> PlugserveServer:
    return PlugserveServer(log_dir / f"server-{label}.log", transport="zmq", settings=settings)


LLAMASERVER = "llama-server"
LLAMASERVER_MODEL = "smollm2"  # run_llamaserver.sh's alias


def llamaserver(peers_dir: Path, slots: int, log_dir: Path) -> ServerProcess:
    env = {"NP": str(slots), "CTX": str(slots * 2048)}
    return peer_server("llamaserver", peers_dir / "run_llamaserver.sh", env, log_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1 8")
    parser.add_argument("--proposer", default="ngram")
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each case, alternating")
    parser.add_argument("--num-random", type=int, default=16)
    parser.add_argument("--workloads", default="copy-heavy random")
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-llamaserver", action="store_true")
    parser.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    args = parser.parse_args()
    with_peer = not args.skip_llamaserver
    if with_peer and not (ANCHORS / "llama-server/bin/llama-server").is_file():
        print(f"llama-server skipped: not built (run {args.peers_dir}/setup_llamaserver.sh)")
        with_peer = False
    concurrencies = [int(c) for c in args.concurrency.split()]
    loads = {
        name: bodies
        for name, bodies in workloads(args.num_random, seed=0).items()
        if name in args.workloads.split()
    }
    base = ["--dtype", "bfloat16", "--max-num-seqs", str(max(concurrencies))]
    base += ["--enable-prefix-caching", "false"]
    configs = {
        "plain": base,
        "speculative": [
            *base,
            "--stack.speculative.proposer", args.proposer,
            "--stack.speculative.num_tokens", str(args.num_tokens),
        ],
    }  # fmt: skip
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for label in [*configs, *([LLAMASERVER] if with_peer else [])]:
                peer = label == LLAMASERVER
                server = (
                    llamaserver(args.peers_dir, max(concurrencies), Path(tmp))
                    if peer
                    else serve(label, configs[label], Path(tmp))
                )
                with server.running(check_exit=not peer):
                    for workload, bodies in loads.items():
                        if peer and workload != "copy-heavy":
                            continue
                        for c in concurrencies:
                            before = {} if peer else spec_counters(server)
                            outputs, duration = asyncio.run(
                                run_workload(server, bodies, c, peer=peer)
                            )
                            row = {
                                "round": round_,
                                "config": label,
                                "workload": workload,
                                "concurrency": c,
                                **summarize(outputs, duration),
                                **({} if peer else acceptance(before, spec_counters(server))),
                            }
                            results.append(row)
                            print(json.dumps(row), flush=True)
    print()
    print(table(results, concurrencies, list(loads)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def table(results: list[dict[str, Any]], concurrencies: list[int], names: list[str]) -> str:
    """Per workload and concurrency: the best round of each config, and their ratio."""
    lines = [
        "| workload | c | plain tok/s | speculative tok/s | ratio | plain TPOT ms "
        "| spec TPOT ms | llama-server TPOT ms | acceptance | mean accepted length "
        "| per position |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        for c in concurrencies:
            rows = [r for r in results if r["workload"] == name and r["concurrency"] == c]
            plain = max((r for r in rows if r["config"] == "plain"), key=_speed)
            spec = max((r for r in rows if r["config"] == "speculative"), key=_speed)
            peers = [r for r in rows if r["config"] == LLAMASERVER]
            peer = f"{max(peers, key=_speed)['median_tpot_ms']:.2f}" if peers else "-"
            rate = spec.get("acceptance_rate")
            lines.append(
                f"| {name} | {c} | {plain['output_throughput']:.1f} "
                f"| {spec['output_throughput']:.1f} "
                f"| {spec['output_throughput'] / plain['output_throughput']:.2f}x "
                f"| {plain['median_tpot_ms']:.2f} | {spec['median_tpot_ms']:.2f} | {peer} "
                f"| {f'{100 * rate:.0f}%' if rate is not None else '-'} "
                f"| {spec.get('mean_accepted_length', 1.0):.2f} "
                f"| {', '.join(str(p) for p in spec.get('per_position', []))} |"
            )
    return "\n".join(lines)


def _speed(row: dict[str, Any]) -> float:
    return row["output_throughput"]


if __name__ == "__main__":
    main()
