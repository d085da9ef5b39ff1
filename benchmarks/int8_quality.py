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
- the statistics `llama-perplexity --kl-divergence` prints for a quantized model against
  its base, on the same scored tokens: the mean of ln(PPL(Q)/PPL(base)) with its
  standard error (the per-token logprob differences' spread), the mean and RMS of Δp
  (the quantized model's probability of each token less bf16's) and "same top p" (the
  share of positions whose most likely token is the same), so llama.cpp's Q4_1 against
  the same weights in bf16 can be set beside them;
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
from dataclasses import dataclass, field
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


@dataclass
class Scored:
    """Per scored token: its logprob given the tokens before it, and the most likely
    token at its position."""

    logprobs: list[float] = field(default_factory=list)
    top_tokens: list[int] = field(default_factory=list)

    def add(self, token: int, entry: dict[int, Any]) -> None:
        self.logprobs.append(entry[token].logprob)
        self.top_tokens.append(next(t for t, lp in entry.items() if lp.rank == 1))


def scored_logprobs(llm: LLM, token_ids: list[int]) -> Scored:
    """Every token of the text given the tokens before it."""
    [out] = llm.generate(
        {"prompt_token_ids": token_ids}, SamplingParams(max_tokens=1, prompt_logprobs=1)
    )
    assert out.prompt_logprobs is not None
    scored = Scored()
    for token, entry in zip(token_ids[1:], out.prompt_logprobs[1:], strict=True):
        scored.add(token, entry)
    return scored


def chunked_logprobs(llm: LLM, token_ids: list[int], chunk: int) -> Scored:
    """llama-perplexity's protocol: each whole chunk of `chunk` tokens alone, the tokens of
    its second half scored."""
    scored = Scored()
    for start in range(0, len(token_ids) - chunk + 1, chunk):
        tokens = token_ids[start : start + chunk]
        [out] = llm.generate(
            {"prompt_token_ids": tokens}, SamplingParams(max_tokens=1, prompt_logprobs=1)
        )
        assert out.prompt_logprobs is not None
        for j in range(chunk // 2 + 1, chunk):
            scored.add(tokens[j], out.prompt_logprobs[j])
    return scored


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params)]


def probability_shift(base: Scored, quantized: Scored) -> dict[str, float]:
    """llama-perplexity's statistics of `quantized` against `base`: the mean of
    ln(PPL(Q)/PPL(base)) and its standard error; in percent, the mean and RMS of Δp and
    the share of positions with the same top token."""
    log_ratios = [b - q for b, q in zip(base.logprobs, quantized.logprobs, strict=True)]
    n = len(log_ratios)
    mean_log_ratio = sum(log_ratios) / n
    spread = math.sqrt(sum((d - mean_log_ratio) ** 2 for d in log_ratios) / (n - 1))
    shifts = [
        math.exp(q) - math.exp(b) for b, q in zip(base.logprobs, quantized.logprobs, strict=True)
    ]
    same_top = sum(
        a == b for a, b in zip(base.top_tokens, quantized.top_tokens, strict=True)
    ) / len(shifts)
    return {
        "mean_ln_ppl_ratio": mean_log_ratio,
        "mean_ln_ppl_ratio_error": spread / math.sqrt(n),
        "mean_delta_p_percent": 100 * sum(shifts) / len(shifts),
        "rms_delta_p_percent": 100 * math.sqrt(sum(d * d for d in shifts) / len(shifts)),
        "same_top_p_percent": 100 * same_top,
    }


def run(model: str, linear_method: str | None, chunk: int) -> tuple[Scored, list[list[int]]]:
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
    ppl_bf16, ppl_q = perplexity(scored_bf16.logprobs), perplexity(scored_q.logprobs)
    differences = [abs(a - b) for a, b in zip(scored_bf16.logprobs, scored_q.logprobs, strict=True)]
    shift = probability_shift(scored_bf16, scored_q)
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
        "scored_tokens": len(differences),
        **shift,
        "greedy_agreement": same / total,
        "tokens_before_first_difference": prefixes,
    }
    print(
        f"perplexity bf16 {ppl_bf16:.4f}, {args.linear_method} {ppl_q:.4f} "
        f"(delta {ppl_q - ppl_bf16:+.4f}, {100 * (ppl_q / ppl_bf16 - 1):+.2f} %)\n"
        f"per token, |logprob - bf16's|: mean {result['mean_abs_logprob_difference']:.4f}, "
        f"largest {result['max_abs_logprob_difference']:.3f} ({len(differences)} tokens)\n"
        "as llama-perplexity --kl-divergence: mean ln(PPL(Q)/PPL(base)) "
        f"{shift['mean_ln_ppl_ratio']:+.6f} ± {shift['mean_ln_ppl_ratio_error']:.6f}, "
        f"mean Δp {shift['mean_delta_p_percent']:+.3f} %, "
        f"RMS Δp {shift['rms_delta_p_percent']:.3f} %, "
        f"same top p {shift['same_top_p_percent']:.3f} %\n"
        f"greedy agreement {same}/{total} = {same / total:.3f}; "
        f"tokens before the first difference: {prefixes}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
