"""(b) Teacher-forced agreement: every stack's per-position distribution, against fp32.

The same token sequences (13 prompts, each followed by the same fixed continuation)
go through Hugging Face in fp32 (the reference), Hugging Face in bf16 (the yardstick of
bf16 rounding), and plugserve's stacks in bf16: attention `torch`, `flashinfer` eager,
`flashinfer` with decode CUDA graphs. plugserve runs its real engine (scheduler, paged
KV cache, chunked prefill at a 512-token budget, prefix-cache hits, decode steps across
page boundaries) under the `teacher_forced` executor (teacher_forcing.py), which records
each step's full log-softmax and makes the row take the given token.

Compared per position, against the fp32 reference's log-softmax r:
- decode positions (the full distribution c on both sides): KL(r || c), and the largest
  |c - r| over r's top-20 tokens;
- prompt positions (plugserve's prompt_logprobs, top-20 from full logits): the largest
  |c - r| over plugserve's top-20 tokens and the prompt token;
- the top-1 token, wherever r's top-2 gap is wide (WIDE_GAP times the yardstick's
  largest |c - r|), which no rounding can flip.
Tolerance, measured in the same run: a stack passes when its mean KL, its largest KL and
its 99th-percentile |c - r| (decode and prompt positions) are each at most TOLERANCE x
the bf16 yardstick's (HF bf16 against the same reference), and every wide-gap top-1
agrees. `--plant rope|page` puts a known bug into the plugserve stacks
(teacher_forcing.plant) so the check can be seen to fail on it.

    python benchmarks/gpu/agreement.py --model DIR [--stacks torch,flashinfer] [--plant rope]
"""

from __future__ import annotations

import argparse
import gc
import os
from typing import Any

os.environ["PLUGSERVE_PLUGIN_MODULES"] = ",".join(
    filter(None, [os.environ.get("PLUGSERVE_PLUGIN_MODULES", ""), "teacher_forcing"])
)

import common
import numpy as np
import torch
from teacher_forcing import FORCING

from plugserve import LLM, SamplingParams

CUDA = torch.cuda.is_available()
STACKS = {
    "torch": {"attention": "torch"},
    "flashinfer": {"attention": "flashinfer", "cuda_graphs": False},
    "flashinfer+graphs": {"attention": "flashinfer", "cuda_graphs": True},
}
SETTINGS = {
    "executor": "teacher_forced",
    "dtype": "bfloat16",
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "max_model_len": 1024,
}
# Lengths around the 16-token pages, prompts split into chunks among decodes, and two
# that share a 400-token prefix with the longest (served after it: prefix-cache hits).
LENGTHS = [1, 7, 15, 16, 17, 100, 255, 256, 300, 511, 700]
SHARED_PREFIX, SHARED_TAILS = 400, [50, 120]
QUICK_LENGTHS = [1, 15, 17, 100, 300]  # --quick (CPU dry runs): fewer, shorter
NEW_TOKENS = 32  # decode steps; crosses at least two page boundaries per sequence
TOP = 20
MIN_PREFIX_HIT = 16  # a second-round request must find at least one page cached
TOLERANCE = 4.0
WIDE_GAP = 4.0


def sequences(vocab: int, quick: bool) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(first-round prompts, second-round prompts that hit the cache, continuation)."""
    lengths = QUICK_LENGTHS if quick else LENGTHS
    first = common.random_prompts(len(lengths), lengths, vocab, seed=1)
    longest = max(first, key=len)
    prefix = longest[: min(SHARED_PREFIX, len(longest) - 1)]
    second = [prefix + tail for tail in common.random_prompts(2, SHARED_TAILS, vocab, seed=2)]
    continuation = common.random_prompts(1, NEW_TOKENS, vocab, seed=3)[0]
    return first, second, continuation


# ------------------------------------------------------------------ the two HF stacks


def hf_logprobs(model_dir: str, dtype: torch.dtype, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, the float32 log-softmax at every position but the last: row j is
    the distribution of token j + 1."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if CUDA else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    out = []
    with torch.inference_mode():
        for seq in seqs:
            ids = torch.tensor([seq[:-1]], device=device)
            out.append(model(input_ids=ids).logits[0].float().log_softmax(-1))
    del model
    free()
    return out


def free() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ a plugserve stack


def plugserve_logprobs(
    model_dir: str,
    stack: dict[str, Any],
    first: list[list[int]],
    second: list[list[int]],
    continuation: list[int],
    plant: str | None,
) -> dict[str, Any]:
    """Per sequence (first then second round): decode-position log-softmax rows
    [NEW_TOKENS, vocab] and prompt logprobs (first round only: a request that asks for
    them takes no prefix-cache hit), plus each second-round request's cached tokens."""
    FORCING.reset({tuple(p): continuation for p in first + second}, plant)
    llm = LLM(model=model_dir, **SETTINGS, **stack)
    forced = dict(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    one = llm.generate(
        [{"prompt_token_ids": p} for p in first],
        SamplingParams(prompt_logprobs=TOP, **forced),
    )
    two = llm.generate([{"prompt_token_ids": p} for p in second], SamplingParams(**forced))
    result: dict[str, Any] = {"decode": [], "prompt": [], "cached": []}
    for prompt, out in zip(first + second, one + two, strict=True):
        assert out.outputs[0].token_ids == continuation, "the runner did not force its tokens"
        seen = FORCING.seen[tuple(prompt)]
        result["decode"].append(torch.stack([seen[k] for k in range(NEW_TOKENS)]))
    for out in one:
        result["prompt"].append(
            [{t: lp.logprob for t, lp in step.items()} for step in out.prompt_logprobs[1:]]
        )
    result["cached"] = [out.num_cached_tokens for out in two]
    del llm, one, two
    free()
    return result


# ------------------------------------------------------------------ measures


def decode_measures(ref_rows: torch.Tensor, cand_rows: torch.Tensor) -> dict[str, np.ndarray]:
    """Per decode position: KL(ref || cand), the largest |cand - ref| over ref's top-20,
    ref's top-2 gap and whether both top-1 tokens agree."""
    ref_rows, cand_rows = ref_rows.float().cpu(), cand_rows.float().cpu()
    kl = (ref_rows.exp() * (ref_rows - cand_rows)).sum(-1)
    top = ref_rows.topk(TOP, dim=-1)
    diff = (cand_rows.gather(-1, top.indices) - top.values).abs().amax(-1)
    return {
        "kl": kl.numpy(),
        "diff": diff.numpy(),
        "gap": (top.values[:, 0] - top.values[:, 1]).numpy(),
        "top1_same": (cand_rows.argmax(-1) == top.indices[:, 0]).numpy(),
    }


def prompt_measures(ref_rows: torch.Tensor, cand: list[dict[int, float]]) -> dict[str, np.ndarray]:
    """Per prompt position (cand: plugserve's top-20 and the prompt token, by token)."""
    ref_rows = ref_rows.float().cpu()
    diff, gap, same = [], [], []
    for j, entry in enumerate(cand):
        tokens = list(entry)
        values = torch.tensor([entry[t] for t in tokens])
        diff.append(float((values - ref_rows[j, tokens]).abs().max()))
        ref_top = ref_rows[j].topk(2)
        gap.append(float(ref_top.values[0] - ref_top.values[1]))
        best = max(entry, key=entry.__getitem__)
        same.append(best == int(ref_top.indices[0]))
    return {
        "diff": np.array(diff, dtype=np.float64),
        "gap": np.array(gap, dtype=np.float64),
        "top1_same": np.array(same, dtype=bool),
    }


def summarize(decode: list[dict], prompt: list[dict]) -> dict[str, float]:
    kl = np.concatenate([m["kl"] for m in decode])
    d_diff = np.concatenate([m["diff"] for m in decode])
    p_diff = np.concatenate([m["diff"] for m in prompt]) if prompt else np.zeros(1)
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "decode_diff_p99": float(np.percentile(d_diff, 99)),
        "decode_diff_max": float(d_diff.max()),
        "prompt_diff_p99": float(np.percentile(p_diff, 99)),
        "prompt_diff_max": float(p_diff.max()),
        "decode_positions": int(kl.size),
        "prompt_positions": int(sum(m["diff"].size for m in prompt)),
    }


def wide_gap_flips(measures: list[dict], wide: float) -> tuple[int, int]:
    """(positions whose reference top-2 gap exceeds `wide`, how many of them flipped)."""
    gap = np.concatenate([m["gap"] for m in measures])
    same = np.concatenate([m["top1_same"] for m in measures])
    return int((gap > wide).sum()), int(((gap > wide) & ~same).sum())


def verdict(summary: dict[str, float], yardstick: dict[str, float]) -> list[str]:
    """The measures over TOLERANCE x the yardstick's (empty: pass)."""
    return [
        f"{key} {summary[key]:.3g} > {TOLERANCE:g} x {yardstick[key]:.3g}"
        for key in ("kl_mean", "kl_max", "decode_diff_p99", "prompt_diff_p99")
        if summary[key] > TOLERANCE * yardstick[key]
    ]


# ------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--stacks",
        default=",".join(STACKS) if CUDA else "torch",
        help=f"plugserve stacks to compare, of {', '.join(STACKS)}",
    )
    parser.add_argument("--plant", choices=("rope", "page"), default=None)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter prompts")
    parser.add_argument("--name", default=None, help="result part name (default from --plant)")
    args = parser.parse_args()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    first, second, continuation = sequences(vocab, args.quick)
    seqs = [p + continuation for p in first + second]
    with common.timed("HF fp32 reference"):
        ref = hf_logprobs(args.model, torch.float32, seqs)
    with common.timed("HF bf16 yardstick"):
        hf16 = hf_logprobs(args.model, torch.bfloat16, seqs)

    def decode_rows(rows: list[torch.Tensor], i: int) -> torch.Tensor:
        start = len((first + second)[i]) - 1
        return rows[i][start : start + NEW_TOKENS]

    # The yardstick, read as plugserve is read: full rows at decode positions, its own
    # top-20 (and the prompt token) at the first round's prompt positions.
    def hf_top(rows: torch.Tensor, prompt: list[int]) -> list[dict[int, float]]:
        rows = rows[: len(prompt) - 1].float().cpu()
        top = rows.topk(TOP, dim=-1)
        return [
            {**dict(zip(top.indices[j].tolist(), top.values[j].tolist(), strict=True)),
             prompt[j + 1]: float(rows[j, prompt[j + 1]])}
            for j in range(len(prompt) - 1)
        ]  # fmt: skip

    stacks: dict[str, dict[str, Any]] = {}
    y_decode = [
        decode_measures(decode_rows(ref, i), decode_rows(hf16, i)) for i in range(len(seqs))
    ]
    y_prompt = [prompt_measures(ref[i], hf_top(hf16[i], p)) for i, p in enumerate(first)]
    yardstick = summarize(y_decode, y_prompt)
    wide = WIDE_GAP * max(yardstick["decode_diff_max"], yardstick["prompt_diff_max"])
    stacks["hf-bf16"] = {"summary": yardstick, "wide": wide_gap_flips(y_decode + y_prompt, wide)}
    del hf16
    free()

    passed = True
    for name in [s for s in args.stacks.split(",") if s]:
        try:
            with common.timed(f"{name}: load + {len(seqs)} forced sequences"):
                got = plugserve_logprobs(
                    args.model, STACKS[name], first, second, continuation, args.plant
                )
        except Exception as exc:  # one stack failing must not hide the others' results
            error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
            print(f"(b) {name} FAILED: {error}", flush=True)
            stacks[name] = {"passed": False, "error": error}
            passed = False
            free()
            continue
        d = [decode_measures(decode_rows(ref, i), got["decode"][i]) for i in range(len(seqs))]
        p = [prompt_measures(ref[i], got["prompt"][i]) for i in range(len(first))]
        summary = summarize(d, p)
        wide_positions, flips = wide_gap_flips(d + p, wide)
        failures = verdict(summary, yardstick)
        if flips:
            failures.append(f"{flips} of {wide_positions} wide-gap top-1 tokens differ")
        if min(got["cached"]) < MIN_PREFIX_HIT:
            failures.append(f"prefix cache not hit: cached tokens {got['cached']}")
        stacks[name] = {
            "passed": not failures,
            "summary": summary,
            "wide": [wide_positions, flips],
            "cached_tokens": got["cached"],
            "failures": failures,
        }
        passed &= not failures
    report = {
        "passed": passed,
        "plant": args.plant,
        "sequences": len(seqs),
        "new_tokens": NEW_TOKENS,
        "tolerance": TOLERANCE,
        "wide_gap": wide,
        "stacks": stacks,
    }
    print_report(report)
    common.save(args.name or ("agreement" + (f"_plant_{args.plant}" if args.plant else "")), report)
    return 0 if passed else 1


def print_report(report: dict[str, Any]) -> None:
    plant = f", planted bug: {report['plant']}" if report["plant"] else ""
    print(
        f"(b) teacher-forced agreement with HF fp32, {report['sequences']} sequences "
        f"x {report['new_tokens']} forced tokens{plant}: "
        f"{'PASS' if report['passed'] else 'FAIL'} (wide gap {report['wide_gap']:.3f} nats)"
    )
    print(
        f"    {'stack':<18} {'KL mean':>9} {'KL max':>9} {'dec p99':>8} {'dec max':>8} "
        f"{'pr p99':>8} {'pr max':>8} {'wide flips':>11}"
    )
    for name, s in report["stacks"].items():
        if "error" in s:
            print(f"    {name:<18} FAILED: {s['error']}")
            continue
        m = s["summary"]
        wide_positions, flips = s["wide"]
        print(
            f"    {name:<18} {m['kl_mean']:>9.2e} {m['kl_max']:>9.2e} "
            f"{m['decode_diff_p99']:>8.4f} {m['decode_diff_max']:>8.4f} "
            f"{m['prompt_diff_p99']:>8.4f} {m['prompt_diff_max']:>8.4f} "
            f"{flips:>4}/{wide_positions:<6}"
            + ("" if s.get("passed", True) else "  FAIL: " + "; ".join(s["failures"]))
        )


if __name__ == "__main__":
    raise SystemExit(main())
