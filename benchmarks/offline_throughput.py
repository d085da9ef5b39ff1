"""Offline throughput: plugserve's `LLM.generate` against Hugging Face `generate`.

One run on the embedded model (SmolLM2-135M-Instruct): plugserve's load time and output
tokens/s for N prompts submitted at once, then transformers on the same weights and dtype,
one prompt at a time (a subset) and in left-padded batches. Greedy, fixed output length
(EOS ignored), prompts of random non-special token ids from a fixed seed.

    .venv/bin/python benchmarks/offline_throughput.py [--dtype bfloat16] [--skip-hf]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from plugserve import LLM, SamplingParams
from plugserve.model_files import resolve_model_path

MODEL = "smollm2-135m-instruct"
SEED = 0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Row:
    system: str
    prompts: int
    output_tokens: int
    seconds: float

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def build_prompts(tokenizer: Any, num_prompts: int, input_len: int) -> list[list[int]]:
    """`num_prompts` distinct prompts of `input_len` random ids, special ids excluded."""
    special = set(tokenizer.all_special_ids)
    allowed = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
    rng = np.random.default_rng(SEED)
    return [rng.choice(allowed, size=input_len).tolist() for _ in range(num_prompts)]


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_plugserve(
    args: argparse.Namespace, prompts: list[list[int]]
) -> tuple[float, Row, list[list[int]]]:
    start = time.perf_counter()
    llm = LLM(
        model=MODEL, dtype=args.dtype, max_num_seqs=args.num_prompts, num_threads=args.threads
    )
    load_s = time.perf_counter() - start

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warmup = [{"prompt_token_ids": p[:16]} for p in prompts[:2]]
    llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    token_ids = [o.outputs[0].token_ids for o in outputs]
    row = Row("plugserve", len(prompts), sum(len(t) for t in token_ids), seconds)

    llm.engine.shutdown()
    del llm, outputs
    free_memory()
    return load_s, row, token_ids


def hf_generate(model: Any, batch: list[list[int]], output_len: int, pad_id: int) -> torch.Tensor:
    """Left-padded greedy generate of exactly `output_len` tokens per prompt; returns the
    new tokens, [len(batch), output_len]."""
    width = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, prompt in enumerate(batch):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[i, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return out[:, width:]


def run_hf(
    args: argparse.Namespace, model_path: Path, prompts: list[list[int]], pad_id: int
) -> tuple[float, list[Row], list[list[int]]]:
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[args.dtype])
    model.eval()
    load_s = time.perf_counter() - start
    model.generation_config.eos_token_id = None  # run to output_len, never stop early
    for name in ("temperature", "top_p", "top_k"):  # greedy: drop sampling defaults
        setattr(model.generation_config, name, None)

    hf_generate(model, [p[:16] for p in prompts[:2]], 8, pad_id)  # warm-up, not timed

    rows: list[Row] = []
    serial = prompts[: args.hf_serial_prompts]
    start = time.perf_counter()
    produced = sum(hf_generate(model, [p], args.output_len, pad_id).numel() for p in serial)
    rows.append(Row("hf serial", len(serial), produced, time.perf_counter() - start))

    batched: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch_size):
        batch = prompts[i : i + args.hf_batch_size]
        batched.extend(hf_generate(model, batch, args.output_len, pad_id).tolist())
    seconds = time.perf_counter() - start
    label = f"hf batched (bs={args.hf_batch_size})"
    rows.append(Row(label, len(prompts), sum(len(t) for t in batched), seconds))

    del model
    free_memory()
    return load_s, rows, batched


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, float]:
    """(sequences identical, mean length of the common prefix)."""
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return same, float(np.mean(prefixes)) if prefixes else 0.0


def print_table(rows: list[Row]) -> None:
    ours = rows[0].tok_per_s
    header = f"{'system':<22}{'prompts':>8}{'out tok':>9}{'seconds':>9}{'tok/s':>9}{'ps/row':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        ratio = ours / row.tok_per_s if row.tok_per_s else float("nan")
        print(
            f"{row.system:<22}{row.prompts:>8}{row.output_tokens:>9}"
            f"{row.seconds:>9.2f}{row.tok_per_s:>9.1f}{ratio:>8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-serial-prompts", type=int, default=4)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", type=Path, help="save the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    model_path = resolve_model_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = build_prompts(tokenizer, args.num_prompts, args.input_len)
    print(
        f"{MODEL} dtype={args.dtype} prompts={args.num_prompts} input_len={args.input_len} "
        f"output_len={args.output_len} threads={torch.get_num_threads()} "
        f"loadavg(1m)={os.getloadavg()[0]:.2f} cores={os.cpu_count()}"
    )

    load_s, ours, our_tokens = run_plugserve(args, prompts)
    rows = [ours]
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    report["plugserve_load_s"] = load_s
    if not args.skip_hf:
        hf_load_s, hf_rows, hf_tokens = run_hf(args, model_path, prompts, pad_id)
        rows += hf_rows
        same, prefix = agreement(our_tokens, hf_tokens)
        report |= {"hf_load_s": hf_load_s, "greedy_identical": same, "mean_prefix": prefix}

    print()
    print_table(rows)
    print(f"\nplugserve load (LLM construction): {load_s:.2f} s")
    if not args.skip_hf:
        print(f"hf load (from_pretrained): {report['hf_load_s']:.2f} s")
        print(
            f"greedy agreement with hf batched: {report['greedy_identical']}/{len(prompts)} "
            f"identical, mean common prefix {report['mean_prefix']:.1f}/{args.output_len} tokens"
        )
    report["rows"] = [asdict(r) | {"tok_per_s": r.tok_per_s} for r in rows]
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
