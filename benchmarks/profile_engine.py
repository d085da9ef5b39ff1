"""Where a step's time goes: the engine core alone, on the serving workload.

Drives an in-process EngineCore the way the server does at a given concurrency (random
prompts of exactly --input-len tokens, --output-len tokens each with EOS ignored, a new
request admitted as soon as one finishes) and reports:

- step time, forward time (execute_model + sample_tokens) and engine overhead (the
  rest: scheduling, batch updates, output building), from the engine's own StepStats;
- decode-only and prefill-carrying steps separately;
- with --torch-profile, a torch.profiler table of a window of steps, grouped by op.

    .venv/bin/python benchmarks/profile_engine.py [--concurrency 32] [--dtype bfloat16]
        [--torch-profile] [--engine-args "max_num_batched_tokens=4096"] [--json-schema]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import types
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import msgspec
import numpy as np
import torch

from plugserve import hookimpl
from plugserve.bench.dataset import sample_random_prompts
from plugserve.config import load_config
from plugserve.engine.core import EngineCore
from plugserve.engine.step_timer import StepStats
from plugserve.messages import EngineCoreRequest
from plugserve.model_files import resolve_model_path
from plugserve.plugins import PluginRegistry, set_registry
from plugserve.sampling_params import SamplingParams, StructuredOutputsParams


def parse_overrides(text: str) -> dict[str, object]:
    overrides: dict[str, object] = {}
    for item in text.split():
        key, _, value = item.partition("=")
        overrides[key] = {"true": True, "false": False}.get(value.lower(), value)
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engine-args", default="", help='stack.yaml leaf overrides "k=v k=v"')
    parser.add_argument("--torch-profile", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json-schema",
        action="store_true",
        help="every request under structured_output.py's JSON schema (grammar cost)",
    )
    args = parser.parse_args()

    overrides = {
        "dtype": args.dtype,
        "enable_prefix_caching": False,
        "max_num_seqs": max(args.concurrency, 1),
        **parse_overrides(args.engine_args),
    }
    config = load_config(None, overrides)
    steps: list[StepStats] = []
    # Each step's StepStats, through the engine_step_finished hook as any observer plugin.
    registry = PluginRegistry()
    registry.register(
        types.SimpleNamespace(engine_step_finished=hookimpl(lambda stats: steps.append(stats))),
        name="profile_engine",
        distribution="benchmarks",
    )
    set_registry(registry)
    engine = EngineCore(config)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model))
    prompts = [
        tokenizer.encode(text, add_special_tokens=False)
        for text, _ in sample_random_prompts(tokenizer, args.num_prompts, args.input_len, args.seed)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    if args.json_schema:
        from structured_output import SCHEMA

        params = msgspec.structs.replace(
            params, structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA))
        )

    pending = list(enumerate(prompts))
    live = 0

    def admit() -> None:
        nonlocal live
        while pending and live < args.concurrency:
            i, ids = pending.pop(0)
            engine.add_request(
                EngineCoreRequest(
                    request_id=str(i), prompt_token_ids=ids, sampling_params=params, eos_token_id=0
                )
            )
            live += 1

    profiler = None
    started = time.perf_counter()
    num_output = 0
    while pending or live:
        admit()
        if args.torch_profile and profiler is None and len(steps) == 40:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        outputs, _ = engine.step()
        for out in outputs:
            num_output += len(out.new_token_ids)
            if out.finished:
                live -= 1
        if profiler is not None and len(steps) == 40 + args.profile_steps:
            profiler.__exit__(None, None, None)
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    elapsed = time.perf_counter() - started
    report(steps, elapsed, num_output, args)


def report(steps: list[StepStats], elapsed: float, num_output: int, args) -> None:
    groups: dict[str, list[StepStats]] = defaultdict(list)
    for s in steps:
        kind = "decode" if s.num_scheduled_tokens <= args.concurrency else "with prefill"
        groups[kind].append(s)
        groups["all"].append(s)
    print(
        f"\nconcurrency {args.concurrency}, {args.num_prompts} prompts, {args.dtype}: "
        f"{num_output} tokens in {elapsed:.2f} s = {num_output / elapsed:.1f} tok/s, "
        f"{len(steps)} steps"
    )
    print("| steps | n | step ms (mean) | forward ms | overhead ms | overhead % |")
    print("|---|---|---|---|---|---|")
    for kind, group in groups.items():
        step = np.mean([s.step_time for s in group]) * 1e3
        fwd = np.mean([s.forward_time for s in group]) * 1e3
        print(
            f"| {kind} | {len(group)} | {step:.2f} | {fwd:.2f} | {step - fwd:.2f} | "
            f"{100 * (step - fwd) / step:.1f} |"
        )


if __name__ == "__main__":
    main()
