"""An int8 linear method (default int8, W8A8; or int8_weight_only) against bf16 on
SmolLM2-135M: perplexity on a fixed text and greedy agreement (docs/benchmarks.md,
"int8 (W8A8)").

- perplexity: exp of the mean negative logprob of every token of
  benchmarks/data/pride_and_prejudice_ch1.txt (public domain) given the tokens before
  it, through prompt_logprobs; with --chunk-tokens N, as llama.cpp's `llama-perplexity
  -c N` computes it instead: N-token chunks, each alone, the second half of each scored;
- the mean and largest absolute difference between the quantized model's logprob of each
  of those tokens and bf16's: steadier than the perplexity, which a few tokens' changes
  move by tenths of a percent either way;
- greedy agreement: 8 fixed prompts x 64 new tokens (EOS ignored) quantized against
  bf16: the fraction of positions holding the same token, and how many tokens each
  continuation keeps before its first difference.

    .venv/bin/python benchmarks/int8_quality.py [--model smollm2-135m-instruct]
        [--linear-method int8 | int8_weight_only] [--chunk-tokens 256] [--json out]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from plugserve import LLM, SamplingParams

TEXT = Path(__file__).parent / "data" / "pride_and_prejudice_ch1.txt"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village,",
    "The three laws of motion state that",
    "To make a cup of tea, first",
    "In 1969, the first humans",
    "The main difference between a list and a tuple in Python is",
]
NEW_TOKENS = 64


def scored_logprobs(llm: LLM, token_ids: list[int]) -> list[float]:
    """The logprob of every token of the text given the tokens before it."""
    [out] = llm.generate(
        {"prompt_token_ids": token_ids}, SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    assert out.prompt_logprobs is not None
    return [
        entry[token].logprob
        for token, entry in zip(token_ids[1:], out.prompt_logprobs[1:], strict=True)
        if entry is not None
    ]


def chunked_logprobs(llm: LLM, token_ids: list[int], chunk: int) -> list[float]:
    """llama-perplexity's protocol: each whole chunk of `chunk` tokens alone, the tokens of
    its second half scored."""
    logprobs = []
    for start in range(0, len(token_ids) - chunk + 1, chunk):
        tokens = token_ids[start : start + chunk]
        [out] = llm.generate(
            {"prompt_token_ids": tokens}, SamplingParams(max_tokens=1, prompt_logprobs=0)
        )
        assert out.prompt_logprobs is not None
        logprobs += [
            out.prompt_logprobs[j][tokens[j]].logprob for j in range(chunk // 2 + 1, chunk)
        ]
    return logprobs


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params)]


def run(model: str, linear_method: str | None, chunk: int) -> tuple[list[float], list[list[int]]]:
    settings: dict[str, Any] = {
        "dtype": "bfloat16",
        "kv_cache_memory": "64MiB",
        "enable_prefix_caching": False,
    }
    if linear_method is not None:
        settings["linear_method"] = linear_method
    llm = LLM(model=model, **settings)
    try:
        token_ids = llm.tokenizer.encode(TEXT.read_text())
        scored = (
            chunked_logprobs(llm, token_ids, chunk) if chunk else scored_logprobs(llm, token_ids)
        )
        return scored, greedy(llm)
    finally:
        llm.engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--linear-method", default="int8")
    parser.add_argument(
        "--chunk-tokens", type=int, default=0, help="llama-perplexity's -c (0: the whole text)"
    )
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()

    scored_bf16, tokens_bf16 = run(args.model, None, args.chunk_tokens)
    scored_q, tokens_q = run(args.model, args.linear_method, args.chunk_tokens)
    ppl_bf16, ppl_q = perplexity(scored_bf16), perplexity(scored_q)
    differences = [abs(a - b) for a, b in zip(scored_bf16, scored_q, strict=True)]
    same = sum(
        a == b
        for r, q in zip(tokens_bf16, tokens_q, strict=True)
        for a, b in zip(r, q, strict=True)
    )
    total = sum(len(r) for r in tokens_bf16)
    prefixes = [
        next((i for i, (a, b) in enumerate(zip(r, q, strict=True)) if a != b), len(r))
        for r, q in zip(tokens_bf16, tokens_q, strict=True)
    ]
    result = {
        "model": args.model,
        "linear_method": args.linear_method,
        "chunk_tokens": args.chunk_tokens,
        "perplexity_bf16": ppl_bf16,
        "perplexity_quantized": ppl_q,
        "perplexity_delta": ppl_q - ppl_bf16,
        "mean_abs_logprob_difference": sum(differences) / len(differences),
        "max_abs_logprob_difference": max(differences),
        "greedy_agreement": same / total,
        "tokens_before_first_difference": prefixes,
    }
    print(
        f"perplexity bf16 {ppl_bf16:.4f}, {args.linear_method} {ppl_q:.4f} "
        f"(delta {ppl_q - ppl_bf16:+.4f}, {100 * (ppl_q / ppl_bf16 - 1):+.2f} %)\n"
        f"per token, |logprob - bf16's|: mean {result['mean_abs_logprob_difference']:.4f}, "
        f"largest {result['max_abs_logprob_difference']:.3f}\n"
        f"greedy agreement {same}/{total} = {same / total:.3f}; "
        f"tokens before the first difference: {prefixes}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
