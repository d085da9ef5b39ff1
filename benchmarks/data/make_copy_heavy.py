"""Writes copy_heavy.jsonl, the copy-heavy workload of benchmarks/speculative.py: chat
requests whose answer mostly repeats text the prompt holds, as edits and rewrites do.

Made deterministically from two sources in this repository:
- the paragraphs of pride_and_prejudice_ch1.txt (public domain): "repeat with one name
  changed" and "repeat with the typo fixed" (a typo put in by swapping two letters of
  one word);
- short Python functions of plugserve itself (their source at the time the file was
  made): "rename this variable and give the whole function back".

Each line: {"id", "messages": [one user message], "max_tokens"}. Regenerate with

    .venv/bin/python benchmarks/data/make_copy_heavy.py
"""

from __future__ import annotations

import inspect
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).parent
MAX_TOKENS = 128
NAMES = [("Mr. Bennet", "Mr. Smith"), ("Mrs. Long", "Mrs. Short"), ("Bingley", "Brandon")]


def paragraphs() -> list[str]:
    text = (HERE / "pride_and_prejudice_ch1.txt").read_text()
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) > 60]


def functions() -> list[tuple[str, str]]:
    """(source, a variable in it) of a few short plugserve functions."""
    from plugserve.engine.speculation import SpecDecodeStats
    from plugserve.frontend.metrics import build_1_2_5_buckets
    from plugserve.messages import add_stats, stats_since
    from plugserve_plugins.kvcache.paged import hash_block_tokens
    from plugserve_plugins.spec_proposers.ngram import propose_from_context

    chosen = [
        (propose_from_context, "proposal"),
        (build_1_2_5_buckets, "buckets"),
        (hash_block_tokens, "digest"),
        (stats_since, "delta"),
        (add_stats, "total"),
        (SpecDecodeStats.record, "per_pos"),
    ]
    return [(inspect.getsource(f), name) for f, name in chosen]


def with_typo(text: str, rng: random.Random) -> str:
    words = [m for m in re.finditer(r"[a-z]{6,}", text)]
    word = rng.choice(words)
    i = rng.randrange(1, len(word.group()) - 2)
    w = word.group()
    typo = w[:i] + w[i + 1] + w[i] + w[i + 2 :]
    return text[: word.start()] + typo + text[word.end() :]


def records() -> list[dict]:
    rng = random.Random(0)
    out = []
    for i, paragraph in enumerate(paragraphs()):
        old, new = next(((o, n) for o, n in NAMES if o in paragraph), (None, None))
        if old is not None:
            ask = f"Repeat the text below exactly, changing only '{old}' to '{new}'."
        else:
            paragraph = with_typo(paragraph, rng)
            ask = "Repeat the text below exactly, with its one spelling mistake fixed."
        out.append({"id": f"text-{i}", "content": f"{ask}\n\n{paragraph}"})
    for i, (source, name) in enumerate(functions()):
        ask = (
            f"Rename the variable `{name}` to `{name}_new` in this Python function and "
            "give back the whole function, nothing else."
        )
        out.append({"id": f"code-{i}", "content": f"{ask}\n\n```python\n{source}```"})
    return [
        {
            "id": r["id"],
            "messages": [{"role": "user", "content": r["content"]}],
            "max_tokens": MAX_TOKENS,
        }
        for r in out
    ]


if __name__ == "__main__":
    lines = [json.dumps(r) for r in records()]
    (HERE / "copy_heavy.jsonl").write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} requests written to {HERE / 'copy_heavy.jsonl'}")
