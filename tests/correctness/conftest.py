"""Shared inputs for the correctness suite: prompts of mixed lengths and the Hugging Face
reference continuations, computed once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from correctness.tiny_checkpoints import CHUNK_TOKENS, tokenizer_folder

# Varied natural text, so that greedy continuations are not degenerate repetitions.
CORPUS = """\
The history of the printing press begins in the fifteenth century, when Johannes
Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a
system that could produce books far faster than any scribe. Within fifty years printing
shops had spread to more than two hundred cities across Europe, and the price of books
fell so sharply that reading stopped being a privilege of monasteries and courts.
Photosynthesis is the process by which green plants, algae and some bacteria convert
light energy into chemical energy. Chlorophyll absorbs mostly blue and red light, which
is why leaves look green, and the energy drives the splitting of water molecules,
releasing oxygen as a by-product while carbon dioxide is fixed into sugars.
def merge_sorted(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    return result + left[i:] + right[j:]
In economics, inflation describes a general rise in prices across an economy over a
period of time. Central banks usually respond by raising interest rates, which makes
borrowing more expensive, slows spending and investment, and eventually brings price
growth back toward a target, often around two percent a year. Critics argue that such
policies can raise unemployment in the short run, especially for younger workers.
Mount Everest, known in Nepali as Sagarmatha and in Tibetan as Chomolungma, is Earth's
highest mountain above sea level. The first confirmed ascent was made in 1953 by Tenzing
Norgay and Edmund Hillary, who approached from the southeast ridge. Today hundreds of
climbers attempt the summit each spring, when a brief window of calmer winds opens.
A recipe for a simple tomato soup: soften one chopped onion and two cloves of garlic in
olive oil, add a kilogram of ripe tomatoes, a pinch of salt and a little sugar, simmer
for twenty minutes, then blend until smooth and finish with fresh basil and cream.
"""

PROMPT_LENGTHS = (10, 23, 47, 88, 150, 215, 300, 400)
# Two 16-token blocks filled by decoding after every prompt, whatever its length.
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


# The bf16 sets' continuation length: offline (test_bf16_matches_hf.py) and served
# (tests/integration/test_bf16_served.py) share the prompts and so the references, which
# are computed once per session.
BF16_NEW_TOKENS = 32


@pytest.fixture(scope="session")
def mixed_prompts(tokenizer) -> list[list[int]]:
    return mixed_prompt_ids(tokenizer)


def mixed_prompt_ids(tokenizer) -> list[list[int]]:
    """Eight prompts of 10–400 tokens, each starting at a different place in the corpus."""
    ids = tokenizer.encode(CORPUS * 2)
    prompts = []
    for i, length in enumerate(PROMPT_LENGTHS):
        start = (i * 37) % 150
        prompts.append(ids[start : start + length])
    assert [len(p) for p in prompts] == list(PROMPT_LENGTHS)
    return prompts


@pytest.fixture(scope="session")
def hf_greedy(hf_greedy_generate, mixed_prompts) -> list[list[int]]:
    """Hugging Face `generate`, greedy, fp32, one prompt at a time, exactly MAX_NEW_TOKENS
    new tokens."""
    return hf_greedy_generate(mixed_prompts, MAX_NEW_TOKENS)


# For tiny checkpoints (tiny_checkpoints.py): lengths on both sides of CHUNK_TOKENS and
# of the 16-token block; the last prompt repeats the first 40 tokens of the longest, so
# its first two blocks are found in the prefix cache when it runs after it.
TINY_PROMPT_LENGTHS = (3, 17, 33, 50, 71, 100)


@pytest.fixture(scope="session")
def tiny_tokenizer(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's tokenizer files, which every tiny checkpoint is paired with."""
    return tokenizer_folder(smollm2_path, tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_prompts(tokenizer) -> list[list[int]]:
    """Seven prompts of 3-100 tokens for tiny checkpoints, one sharing another's prefix."""
    ids = tokenizer.encode(CORPUS)
    prompts = [ids[i * 41 : i * 41 + n] for i, n in enumerate(TINY_PROMPT_LENGTHS)]
    prompts.append(prompts[-1][:40] + ids[600:611])
    assert max(map(len, prompts)) > 2 * CHUNK_TOKENS
    return prompts
