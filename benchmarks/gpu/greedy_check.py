"""(b) The FlashInfer stack and the torch stack decode the same greedy tokens.

One random-weights Llama-3.2-1B-shaped model, bf16, served three ways through the
offline API: attention `torch` (the reference), `flashinfer` run eagerly, and
`flashinfer` with decode CUDA graphs. The prompts mix lengths around page boundaries,
long prompts split into chunks mixed with decodes (max_num_batched_tokens 512), and
two prompts sharing a 400-token prefix (prefix-cache hits), 32 new tokens each.

Two bf16 kernels never agree bit for bit, so a sequence may diverge where its two best
tokens are nearly tied. A divergence is accepted only when shown to be such a
tie-break: at the first differing position p (same prefix on both sides), each stack's
pick is the other's runner-up, and both stacks' top-2 logprob gaps there (= logit
gaps) are at most tol = max(4 * eps, 0.02), eps being the largest difference between
the two stacks' logprobs of the agreed tokens before p on that sequence (their
measured numerical noise). Anything else fails the check.

    python benchmarks/gpu/greedy_check.py --model DIR
"""

from __future__ import annotations

import argparse
import gc
import math

import common
import torch

from plugserve import LLM, SamplingParams

STACKS = {
    "torch": {"attention": "torch"},
    "flashinfer": {"attention": "flashinfer", "cuda_graphs": False},
    "flashinfer+graphs": {"attention": "flashinfer", "cuda_graphs": True},
}
SETTINGS = {
    "dtype": "bfloat16",
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "max_model_len": 1024,
    "gpu_memory_utilization": 0.6,
}
LENGTHS = [1, 7, 15, 16, 17, 100, 255, 256, 300, 511, 700]
NEW_TOKENS = 32


def prompts(vocab_size: int) -> list[list[int]]:
    out = common.random_prompts(len(LENGTHS), LENGTHS, vocab_size, seed=1)
    shared = out[-1][:400]
    for tail in common.random_prompts(2, [50, 120], vocab_size, seed=2):
        out.append(shared + tail)
    return out


def generate(model: str, stack: dict, prompt_ids: list[list[int]]) -> list[dict]:
    llm = LLM(model=model, **SETTINGS, **stack)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    result = [
        {
            "tokens": o.outputs[0].token_ids,
            "logprobs": [
                {t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs
            ],
        }
        for o in outs
    ]
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def compare(ref: dict, cand: dict) -> dict:
    """First divergence of one sequence and whether a near-tie explains it."""
    pos = next(
        (i for i, (a, b) in enumerate(zip(ref["tokens"], cand["tokens"], strict=True)) if a != b),
        None,
    )
    if pos is None:
        return {"identical": True, "accepted": True}
    eps = max(
        (
            abs(r[t] - c[t])
            for t, r, c in zip(ref["tokens"][:pos], ref["logprobs"], cand["logprobs"], strict=False)
        ),
        default=0.0,
    )
    a, b = ref["tokens"][pos], cand["tokens"][pos]
    ref_lp, cand_lp = ref["logprobs"][pos], cand["logprobs"][pos]
    gap_ref = ref_lp[a] - ref_lp.get(b, -math.inf)
    gap_cand = cand_lp[b] - cand_lp.get(a, -math.inf)
    tol = max(4 * eps, 0.02)
    return {
        "identical": False,
        "position": pos,
        "ref_token": a,
        "cand_token": b,
        "gap_ref": gap_ref,
        "gap_cand": gap_cand,
        "noise_eps": eps,
        "tol": tol,
        "accepted": bool(gap_ref <= tol and gap_cand <= tol),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompt_ids = prompts(vocab)
    outputs, errors = {}, {}
    for name, stack in STACKS.items():
        try:
            with common.timed(f"{name}: load + generate {len(prompt_ids)} x {NEW_TOKENS}"):
                outputs[name] = generate(args.model, stack, prompt_ids)
        except Exception as exc:  # one stack failing must not hide the others' results
            errors[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            print(f"(b) {name} FAILED: {errors[name]}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    report: dict = {"prompts": len(prompt_ids), "new_tokens": NEW_TOKENS, "stacks": {}}
    passed = "torch" in outputs
    for name in ("flashinfer", "flashinfer+graphs"):
        if name in errors or "torch" not in outputs:
            report["stacks"][name] = {
                "passed": False,
                "error": errors.get(name) or f"reference failed: {errors.get('torch')}",
                "identical": 0,
                "sequences": [],
            }
            passed = False
            continue
        rows = [compare(r, c) for r, c in zip(outputs["torch"], outputs[name], strict=True)]
        ok = all(r["accepted"] for r in rows)
        passed &= ok
        identical = sum(r["identical"] for r in rows)
        report["stacks"][name] = {"passed": ok, "identical": identical, "sequences": rows}
        print(f"(b) {name} vs torch: {identical}/{len(rows)} identical -> {'ok' if ok else 'FAIL'}")
        for i, r in enumerate(rows):
            if not r["identical"]:
                print(
                    f"  prompt {i} (len {len(prompt_ids[i])}): first divergence at token "
                    f"{r['position']}: torch {r['ref_token']} vs {r['cand_token']}, top-2 gap "
                    f"{r['gap_ref']:.4f} (torch) / {r['gap_cand']:.4f} ({name}), noise "
                    f"{r['noise_eps']:.4f}, tol {r['tol']:.4f} -> "
                    f"{'tie-break' if r['accepted'] else 'NOT a tie'}"
                )
    report["passed"] = passed
    common.save("greedy", report)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
