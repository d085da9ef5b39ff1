"""What engine.batch_invariant costs: the embedded model (SmolLM2-135M-Instruct) in bf16,
offline, the default engine against one with the mode on, in one process and one run.

Three measurements, each taken in alternating rounds (default, invariant, default, ...)
so that a change in the machine's speed reaches both alike, medians reported:
- decode at batch 1: one 16-token prompt, 128 tokens out, ms per output token;
- a batch: 16 prompts of 128 tokens, 64 tokens out each, output tokens/s;
- a long prompt: 1024 tokens, 1 token out, the prefill's seconds (TTFT offline).
Greedy, EOS ignored, prompts of random non-special ids from a fixed seed.

    .venv/bin/python benchmarks/batch_invariant.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from plugserve import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"
SEED = 0


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def random_prompts(llm: LLM, count: int, length: int, seed: int) -> list[list[int]]:
    tokenizer = llm.tokenizer
    special = set(tokenizer.all_special_ids)
    allowed = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
    rng = np.random.default_rng(seed)
    return [rng.choice(allowed, size=length).tolist() for _ in range(count)]


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engines = {
        mode: LLM(
            model=MODEL,
            dtype="bfloat16",
            batch_invariant=mode == "invariant",
            max_model_len=2048,
            kv_cache_memory="256MiB",
        )
        for mode in ("default", "invariant")
    }
    reference = engines["default"]
    # Fresh prompts every round: the prefix cache must not serve a repeated prompt.
    cases: dict[str, tuple[Callable[[int], list[list[int]]], int, Callable[[float], float]]] = {
        "batch-1 decode, ms/token": (
            lambda r: random_prompts(reference, 1, 16, 100 + r),
            128,
            lambda s: 1e3 * s / 128,
        ),
        "16 x 128 in, 64 out, tok/s": (
            lambda r: random_prompts(reference, 16, 128, 200 + r),
            64,
            lambda s: 16 * 64 / s,
        ),
        "1024-token prefill, s": (
            lambda r: random_prompts(reference, 1, 1024, 300 + r),
            1,
            lambda s: s,
        ),
    }
    for llm in engines.values():  # warm-up: kernels built, pages touched
        timed(llm, random_prompts(reference, 2, 64, 1), 8)
    results: dict[str, dict[str, list[float]]] = {c: {m: [] for m in engines} for c in cases}
    for r in range(args.rounds):
        for case, (make, max_tokens, figure) in cases.items():
            prompts = make(r)
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for mode in order:
                # Both engines get the same prompts, the second finding none of them
                # cached: each engine has its own prefix cache.
                results[case][mode].append(figure(timed(engines[mode], prompts, max_tokens)))
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; medians of {args.rounds} rounds")
    print("| measurement | default | batch_invariant | invariant / default |")
    print("|---|---|---|---|")
    for case, by_mode in results.items():
        default, invariant = (statistics.median(by_mode[m]) for m in ("default", "invariant"))
        print(f"| {case} | {default:.2f} | {invariant:.2f} | {invariant / default:.2f}x |")


if __name__ == "__main__":
    main()
