"""The bandwidth floor of a decode step: weight bytes read / memory read bandwidth.

A batch-1 decode step reads every weight once (the embedding table only as the tied LM
head), so no engine can run one faster than `weight_bytes_per_step / read bandwidth`. The
performance targets are ratios against this floor, and on a shared VM the bandwidth moves
between minutes (docs/benchmarks-history.md, "Figures from code comments"):
measure it just before and just after the latency it judges.

    python -m plugserve.bench.roofline [--model smollm2-135m-instruct] [--dtype-bytes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

READ_BYTES = 1 << 30  # 1 GiB: far beyond any last-level cache


def weight_bytes_per_step(model: str, dtype_bytes: int = 2) -> int:
    """Bytes of weights one decode step reads: all of them except the embedding table,
    of which it reads a few rows (unless the LM head shares it)."""
    from transformers import AutoConfig

    from plugserve.model_files import resolve_model_path
    from plugserve.worker.random_model import LlamaShape, num_parameters

    c = AutoConfig.from_pretrained(resolve_model_path(model))
    shape = LlamaShape(
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        bool(c.tie_word_embeddings),
        vocab_size=c.vocab_size,
    )
    params = num_parameters(shape)
    if not shape.tie_word_embeddings:
        params -= shape.vocab_size * shape.hidden_size
    return params * dtype_bytes


def cpu_read_bandwidth(
    threads: int | None = None, seconds: float = 2.0, num_bytes: int = READ_BYTES
) -> float:
    """Bytes/s that `threads` threads (default: every core, as the engine uses) read from
    memory now, over a fresh buffer of `num_bytes` (1 GiB): see read_bandwidth."""
    return read_bandwidth(torch.ones(num_bytes // 4, dtype=torch.float32), seconds, threads)


def read_bandwidth(data: torch.Tensor, seconds: float = 2.0, threads: int | None = None) -> float:
    """Bytes/s at which `threads` threads (default: every core) read `data` (contiguous,
    on the CPU) now: the median over `seconds` of int32 max-reductions over its bytes,
    which take any bit pattern (an engine's weights, say) at the speed of a float sum.

    The median, not the best: on a shared VM single passes swing widely within a second,
    and a latency measured over a run meets the typical rate, not the luckiest. A float
    sum reads about as fast as a hand-written AVX-512 load loop, and an int32 max as fast
    as the sum. The rate also depends on where the buffer lies (two buffers can read at
    rates far apart in the same second), so a floor meant for an engine's step is best
    measured on that engine's weights (docs/benchmarks-history.md, "Figures from code
    comments")."""
    words = data.reshape(-1).view(torch.uint8)
    words = words[: words.numel() // 4 * 4].view(torch.int32)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        words.amax()  # page the buffer in
        rates: list[float] = []
        deadline = time.perf_counter() + seconds
        while not rates or time.perf_counter() < deadline:
            start = time.perf_counter()
            words.amax()
            rates.append(words.numel() * 4 / (time.perf_counter() - start))
        return statistics.median(rates)
    finally:
        torch.set_num_threads(previous)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="2 for bf16")
    args = parser.parse_args()
    weight_bytes = weight_bytes_per_step(args.model, args.dtype_bytes)
    bandwidth = cpu_read_bandwidth()
    floor_ms = weight_bytes / bandwidth * 1e3
    print(
        json.dumps(
            {
                "weight_bytes": weight_bytes,
                "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
                "floor_ms": round(floor_ms, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
