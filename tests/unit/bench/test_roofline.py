"""The bandwidth floor's two inputs: the bytes of weights a decode step reads, and the
machine's memory read bandwidth."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from plugserve.bench.roofline import cpu_read_bandwidth, read_bandwidth, weight_bytes_per_step
from plugserve.worker.model_loader import iter_weights
from plugserve.worker.random_model import SHAPES, write_random_model


def test_a_tied_model_reads_every_checkpoint_tensor_once(smollm2_path: Path) -> None:
    # SmolLM2 ties its LM head to the embedding: the table is read once, as the head.
    total = sum(t.numel() for _, t in iter_weights(smollm2_path))
    assert weight_bytes_per_step(str(smollm2_path)) == 2 * total == 269_030_016


def test_an_untied_model_skips_the_embedding_table(tmp_path: Path) -> None:
    shape = dataclasses.replace(SHAPES["tiny"], tie_word_embeddings=False)
    folder = write_random_model(tmp_path / "untied", shape)
    weights = dict(iter_weights(folder))
    embedding = weights["model.embed_tokens.weight"].numel()
    total = sum(t.numel() for t in weights.values())
    assert weight_bytes_per_step(str(folder), dtype_bytes=4) == 4 * (total - embedding)


def test_read_bandwidth_is_a_plausible_rate_and_leaves_the_thread_count() -> None:
    threads = torch.get_num_threads()
    rate = cpu_read_bandwidth(threads=1, seconds=0.1, num_bytes=64 << 20)
    # Between a floppy disk and the fastest HBM: catches unit slips (bits, MiB, ms).
    assert math.isfinite(rate) and 1e8 < rate < 1e13
    assert torch.get_num_threads() == threads


def test_read_bandwidth_reads_any_tensor_whatever_its_bits() -> None:
    # An engine's packed bf16 weights, an odd count of them: NaN and denormal patterns
    # included, which an int32 reduction reads at full speed.
    weights = torch.randint(-(2**15), 2**15, (3 * (1 << 20) + 1,), dtype=torch.int16)
    rate = read_bandwidth(weights.view(torch.bfloat16), seconds=0.05, threads=1)
    assert math.isfinite(rate) and 1e8 < rate < 1e13
