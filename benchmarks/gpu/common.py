"""What the GPU check scripts share: where results go, prompts, timing."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

# Scratch space: models, per-step result files, logs (check.sh sets it).
WORK = Path(os.environ.get("PLUGSERVE_GPU_WORK", "/tmp/plugserve-gpu"))
PARTS = WORK / "parts"
# Token ids below this are special in the embedded tokenizer (and its neighbours): prompts
# stay clear of them, so no prompt holds an EOS or a chat marker.
FIRST_ORDINARY_ID = 100


def save(name: str, data: dict[str, Any]) -> None:
    PARTS.mkdir(parents=True, exist_ok=True)
    (PARTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")


def load(name: str) -> dict[str, Any] | None:
    path = PARTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def random_prompts(
    num: int, length: int | list[int], vocab_size: int, seed: int
) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [length] * num if isinstance(length, int) else length
    return [rng.integers(FIRST_ORDINARY_ID, vocab_size, size=n).tolist() for n in lengths]


@contextmanager
def timed(label: str) -> Iterator[dict[str, float]]:
    """Wall-clock seconds of the block (the caller synchronizes the device)."""
    out: dict[str, float] = {}
    start = time.perf_counter()
    try:
        yield out
    finally:
        out["seconds"] = time.perf_counter() - start
        print(f"  {label}: {out['seconds']:.2f} s", flush=True)
