"""(c) Offline throughput of a bf16 Llama-3-8B-shaped model: plugserve against Hugging
Face `generate`, on the same GPU, at batch 1, 64 and 256 (128-token prompts, exactly
128 new tokens, greedy).

- `bandwidth`: device-to-device copy bandwidth (bytes read + written per second, the
  best of 5 timings of 10 copies of 2 GiB); the HBM floor of a decode step is the
  weight bytes it reads (every weight but the embedding table, unless tied) over it.
- `plugserve`: `LLM.generate` with every prompt submitted at once (CUDA graphs as the
  backend allows, or none with --eager); tokens/s over the
  whole call (prefill included); the decode step time is the median engine step over
  the last 100 steps, when every request is decoding (each step ends synchronized, as
  sampling copies the tokens to the host).
- `hf`: `model.generate` on the same prompts as one batch; tokens/s likewise; the
  decode step time is (time for 128 new tokens - time for 1) / 127.

    python benchmarks/gpu/throughput.py bandwidth
    python benchmarks/gpu/throughput.py plugserve --model DIR [--attention flashinfer]
    python benchmarks/gpu/throughput.py hf --model DIR
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
import torch

from plugserve.bench.roofline import weight_bytes_per_step

BATCHES = (1, 64, 256)
PROMPT_LEN = 128
NEW_TOKENS = 128


def bandwidth() -> int:
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            y.copy_(x)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / 10)
    bytes_per_s = 2 * x.nbytes / best
    print(f"(c) copy bandwidth: {bytes_per_s / 1e12:.2f} TB/s (read + write)")
    common.save("bandwidth", {"bytes_per_s": bytes_per_s, "gpu": torch.cuda.get_device_name()})
    return 0


def _prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    return common.random_prompts(max(BATCHES), PROMPT_LEN, vocab, seed=3)


def plugserve(model_dir: str, attention: str, eager: bool) -> int:
    from plugserve import LLM, SamplingParams

    prompts = _prompts(model_dir)
    label = f"plugserve ({attention}{', eager' if eager else ''})"
    with common.timed(f"{label} start-up: load, profile, graphs") as startup:
        llm = LLM(
            model=model_dir,
            attention=attention,
            cuda_graphs=False if eager else None,
            dtype="bfloat16",
            max_num_seqs=max(BATCHES),
            max_num_batched_tokens=8192,
            max_model_len=PROMPT_LEN + NEW_TOKENS + 16,
            enable_prefix_caching=False,  # every run computes its prompts afresh
        )
    step_times: list[float] = []
    engine_step = llm.engine.step

    def timed_step():  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = engine_step()
        step_times.append(time.perf_counter() - start)
        return out

    llm.engine.step = timed_step  # type: ignore[method-assign]

    def run(batch: int, new_tokens: int) -> float:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        return seconds

    for batch in BATCHES:  # warm-up: every graph size these runs replay, allocator pools
        run(batch, 8)
    rows = []
    for batch in BATCHES:
        step_times.clear()
        seconds = run(batch, NEW_TOKENS)
        step = statistics.median(step_times[-100:])
        rows.append(_row(label, batch, seconds, step))
    common.save(
        f"plugserve_{attention}",
        {
            "startup_s": startup["seconds"],
            "rows": rows,
            "weight_bytes": weight_bytes_per_step(model_dir),
        },
    )
    return 0


def hf(model_dir: str) -> int:
    from transformers import AutoModelForCausalLM

    prompts = _prompts(model_dir)
    with common.timed("hf load") as startup:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, device_map="cuda"
        ).eval()
    model.generation_config.eos_token_id = None  # exactly max_new_tokens, as ignore_eos

    def run(batch: int, new_tokens: int) -> float:
        ids = torch.tensor(prompts[:batch], device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        assert out.shape[1] == PROMPT_LEN + new_tokens
        return time.perf_counter() - start

    run(1, 4)
    rows = []
    for batch in BATCHES:
        first = run(batch, 1)
        seconds = run(batch, NEW_TOKENS)
        rows.append(_row("hf generate", batch, seconds, (seconds - first) / (NEW_TOKENS - 1)))
    common.save("hf", {"startup_s": startup["seconds"], "rows": rows})
    return 0


def _row(system: str, batch: int, seconds: float, step_s: float) -> dict:
    row = {
        "system": system,
        "batch": batch,
        "seconds": seconds,
        "tokens_per_s": batch * NEW_TOKENS / seconds,
        "decode_step_ms": step_s * 1e3,
    }
    print(
        f"(c) {system} batch {batch}: {row['tokens_per_s']:.0f} tok/s, "
        f"decode step {row['decode_step_ms']:.2f} ms ({seconds:.2f} s)",
        flush=True,
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bandwidth")
    p = sub.add_parser("plugserve")
    p.add_argument("--model", required=True)
    p.add_argument("--attention", default="flashinfer")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p = sub.add_parser("hf")
    p.add_argument("--model", required=True)
    args = parser.parse_args()
    if args.command == "bandwidth":
        return bandwidth()
    if args.command == "plugserve":
        return plugserve(args.model, args.attention, args.eager)
    return hf(args.model)


if __name__ == "__main__":
    raise SystemExit(main())
