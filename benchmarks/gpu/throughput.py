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
    python benchmarks/gpu/throughput.py plugserve --model DIR [--attention flashinfer] [--profile]

With --profile, afterwards torch.profiler records PROFILED_STEPS decode steps (prefill
excluded) at batch 1 and 64 and saves, per batch: wall time per step, device kernel time
per step (busy share of the step), kernel launches per step, and the kernels and host
ops that take the most time, so that a step's bound (device or host) is read, not guessed.
    python benchmarks/gpu/throughput.py hf --model DIR
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import common
import torch

from plugserve.bench.roofline import weight_bytes_per_step

BATCHES = (1, 64, 256)
PROFILED_BATCHES = (1, 64)
PROFILED_STEPS = 20
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


def plugserve(
    model_dir: str,
    attention: str,
    eager: bool,
    profile: bool = False,
    batches: tuple[int, ...] = BATCHES,
    name: str | None = None,
) -> int:
    from plugserve import LLM, SamplingParams

    prompts = _prompts(model_dir)
    label = f"plugserve ({attention}{', eager' if eager else ''})"
    with common.timed(f"{label} start-up: load, profile, graphs") as startup:
        llm = LLM(
            model=model_dir,
            attention=attention,
            cuda_graphs=False if eager else None,
            dtype="bfloat16",
            max_num_seqs=max(batches),
            max_num_batched_tokens=8192,
            max_model_len=PROMPT_LEN + NEW_TOKENS + 16,
            enable_prefix_caching=False,  # every run computes its prompts afresh
        )
    step_times: list[float] = []
    engine_step = llm.engine.step
    # Set by profile_decode: (first step to record, profiler).
    recording: dict[str, Any] = {}

    def timed_step():  # type: ignore[no-untyped-def]
        if recording and len(step_times) == recording["first"]:
            recording["profiler"].start()
        start = time.perf_counter()
        out = engine_step()
        step_times.append(time.perf_counter() - start)
        if recording and len(step_times) == recording["first"] + PROFILED_STEPS:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            recording["profiler"].stop()
        return out

    llm.engine.step = timed_step  # type: ignore[method-assign]

    def run(batch: int, new_tokens: int) -> float:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        return seconds

    for batch in batches:  # warm-up: every graph size these runs replay, allocator pools
        run(batch, 8)
    rows = []
    for batch in batches:
        step_times.clear()
        seconds = run(batch, NEW_TOKENS)
        step = statistics.median(step_times[-100:])
        rows.append(_row(label, batch, seconds, step))
    common.save(
        name or f"plugserve_{attention}",
        {
            "startup_s": startup["seconds"],
            "rows": rows,
            "weight_bytes": weight_bytes_per_step(model_dir),
        },
    )
    if profile:
        profiles = []
        for batch in PROFILED_BATCHES:
            step_times.clear()
            profiler = torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            )
            # Step 0 is the prefill; a few decode steps settle before recording.
            recording.update(first=4, profiler=profiler)
            run(batch, 4 + PROFILED_STEPS + 4)
            recording.clear()
            profiles.append(
                _profile_summary(label, batch, profiler, step_times[4 : 4 + PROFILED_STEPS])
            )
        common.save(f"profile_{attention}", {"profiles": profiles})
    return 0


def _profile_summary(label: str, batch: int, profiler: Any, steps: list[float]) -> dict:
    """Per decode step: wall time, device kernel time and launches; the top kernels
    (device time) and host ops (self CPU time), each over the recorded steps."""
    events = profiler.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    top_kernels = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    top_host = sorted(host, key=lambda e: -e.self_cpu_time_total)[:12]
    wall_ms = statistics.median(steps) * 1e3
    summary = {
        "system": label,
        "batch": batch,
        "steps": len(steps),
        "wall_ms_per_step": wall_ms,
        "device_ms_per_step": device_us / 1e3 / len(steps),
        "kernel_launches_per_step": launches / len(steps),
        "top_kernels": [
            [e.key[:90], e.count / len(steps), e.self_device_time_total / 1e3 / len(steps)]
            for e in top_kernels
        ],
        "top_host_ops": [
            [e.key[:90], e.count / len(steps), e.self_cpu_time_total / 1e3 / len(steps)]
            for e in top_host
        ],
    }
    print(
        f"(c) profile {label} batch {batch}: {wall_ms:.2f} ms a step, kernels "
        f"{summary['device_ms_per_step']:.2f} ms "
        f"({summary['kernel_launches_per_step']:.0f} launches)",
        flush=True,
    )
    for name, count, ms in summary["top_kernels"]:
        print(f"    device {ms:7.3f} ms/step {count:6.1f}x  {name}")
    for name, count, ms in summary["top_host_ops"]:
        print(f"    host   {ms:7.3f} ms/step {count:6.1f}x  {name}")
    return summary


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
    p.add_argument("--profile", action="store_true", help="profile decode steps afterwards")
    p.add_argument("--batches", default=" ".join(map(str, BATCHES)))
    p.add_argument("--name", default=None, help="result name (default plugserve_ATTENTION)")
    p = sub.add_parser("hf")
    p.add_argument("--model", required=True)
    args = parser.parse_args()
    if args.command == "bandwidth":
        return bandwidth()
    if args.command == "plugserve":
        batches = tuple(int(b) for b in args.batches.split())
        return plugserve(args.model, args.attention, args.eager, args.profile, batches, args.name)
    return hf(args.model)


if __name__ == "__main__":
    raise SystemExit(main())
