"""The random dataset of `plugserve bench serve`: random-token prompts that tokenize to
an exact length, as `vllm bench serve --dataset-name random --random-range-ratio 0`."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

EMBEDDED_MODEL = "smollm2-135m-instruct"


@lru_cache(maxsize=4)
def get_tokenizer(name: str | None) -> Any:
    """A tokenizer folder, or a built-in model name (default: the embedded model)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    path: str | Path = name or EMBEDDED_MODEL
    if not Path(path).expanduser().is_dir():
        from plugserve.model_files import BUILTIN_MODELS, resolve_model_path

        if str(path).lower() in BUILTIN_MODELS:
            path = resolve_model_path(str(path))
    return AutoTokenizer.from_pretrained(path)


def allowed_token_ids(tokenizer: Any) -> np.ndarray:
    """Every id of the vocabulary but the special and added tokens."""
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return np.array([i for i in range(len(tokenizer)) if i not in excluded], dtype=np.int64)


def random_prompt(
    tokenizer: Any,
    rng: np.random.Generator,
    allowed: np.ndarray,
    length: int,
    *,
    draws: int = 10,
    adjustments: int = 10,
) -> str:
    """Text that tokenizes (without special tokens) to exactly `length` tokens.

    Random ids decode to text that may re-encode to a different count (merges across
    the joins); the re-encoded ids are cut or topped up with fresh random ids and
    checked again. Raises RuntimeError when no attempt lands on the length."""
    if length < 1:
        raise ValueError(f"a prompt needs at least one token, got {length}")
    last = -1
    for _ in range(draws):
        ids = rng.choice(allowed, size=length).tolist()
        for _ in range(adjustments):
            text = tokenizer.decode(ids)
            got = tokenizer.encode(text, add_special_tokens=False)
            last = len(got)
            if last == length:
                return text
            if last > length:
                ids = got[:length]
            else:
                ids = got + rng.choice(allowed, size=length - last).tolist()
    raise RuntimeError(
        f"could not build a random prompt of exactly {length} tokens "
        f"({draws}x{adjustments} attempts, the last re-encoded to {last})"
    )


def sample_random_prompts(
    tokenizer: Any, num_prompts: int, input_len: int, seed: int
) -> list[tuple[str, int]]:
    """`num_prompts` (text, token count) pairs from a numpy RNG seeded with `seed`."""
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    prompts = []
    for _ in range(num_prompts):
        text = random_prompt(tokenizer, rng, allowed, input_len)
        n = len(tokenizer.encode(text, add_special_tokens=False))
        if n != input_len:  # random_prompt checked it: this would be a bug
            raise RuntimeError(f"random prompt has {n} tokens, wanted {input_len}")
        prompts.append((text, n))
    return prompts
