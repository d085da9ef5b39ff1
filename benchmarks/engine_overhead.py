"""The host's share of a step: what plugserve spends per step around a forward pass that
costs next to nothing, by phase, and served beside vLLM's CPU build on the same model.

The model is a random-weights Llama of one layer, hidden 64, with the embedded model's
vocabulary (49,152 tokens, so the logits and the sampling over them are real work):
`plugserve.worker.random_model`'s "overhead" shape, float32 for both servers.

1. In process (`phases`): an EngineCore and the API server's per-request output path,
   driven at 1, 64 and 256 decoding rows; per decode step, milliseconds in each phase:
   - schedule: Scheduler.schedule
   - inputs: execute_model less the forward pass (persistent batch update, step inputs,
     attention metadata)
   - forward: the model and its logits
   - sampling: sample_tokens (sampling metadata, the sampler, the ids back as lists)
   - update: Scheduler.update_from_output
   - messages: the step's outputs encoded and decoded (msgpack, as across the transport)
   - detokenize: each request's detokenizer over its new token (the API server's
     engine_client path, detokenize_output)
   - sse: each request's completion chunk serialized as a server-sent event
   - other: the rest of EngineCore.step (timers, bookkeeping)
   The phases are timed by wrapping the live objects' methods: nothing in the engine
   changes for the benchmark.
2. Served (`served`, needs ../shared/peers set up): `plugserve serve` and vLLM's CPU build
   (run_vllm.sh with MODEL= this folder) one after the other, both driven by vLLM's own
   client (bench.sh), random 128-token prompts, 128 output tokens, EOS ignored, at
   concurrency 1, 64 and 256: output tok/s and ITL p50, and plugserve's ratio at c=64.

    .venv/bin/python benchmarks/engine_overhead.py [phases] [served] [--rows "1 64 256"]
        [--steps 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from plugserve.llm import LLM
from plugserve.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    outputs_decoder,
)
from plugserve.messages import encoder as message_encoder
from plugserve.output_text import detokenize_output
from plugserve.sampling_params import SamplingParams
from plugserve.user_cache import cache_root
from plugserve.worker.random_model import write_random_model

PHASES = (
    "schedule",
    "inputs",
    "forward",
    "sampling",
    "update",
    "messages",
    "detokenize",
    "sse",
    "other",
)
PROMPT_LEN = 32
SERVED_CONCURRENCY = (1, 64, 256)
SERVED_LEN = (128, 128)  # input, output tokens


def overhead_model() -> Path:
    return write_random_model(
        cache_root() / "models" / "random-overhead-fp32",
        "overhead",
        dtype=torch.float32,
        device="cpu",
    )


# -- in process --------------------------------------------------------------------------


class PhaseClock:
    """Seconds spent in each phase, from wrapped methods (a wrapped call nested in another
    counts in both: `inputs` is computed as execute less forward)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, attribute: str, phase: str) -> None:
        method = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - started

        setattr(owner, attribute, timed)

    def timed(self, phase: str, work: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return work()
        finally:
            self.seconds[phase] += time.perf_counter() - started


class StreamedRequest:
    """The API server's state for one streamed completion: its detokenizer and chunk head."""

    def __init__(self, llm: LLM, request_id: str, prompt: list[int], params: SamplingParams):
        self.params = params
        self.detokenizer = llm._detokenizer_cls(
            tokenizer=llm.tokenizer, prompt_token_ids=prompt, params=params
        )
        self.head = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": "overhead",
        }


def sse_chunk(request: StreamedRequest, text: str, finish_reason: str | None) -> bytes:
    from plugserve.frontend.serving import sse_event

    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return sse_event({**request.head, "choices": [choice]})


def measure_rows(llm: LLM, rows: int, steps: int, seed: int) -> dict[str, float]:
    """Per decode step at `rows` rows, milliseconds in each phase (mean over `steps`)."""
    engine = llm.engine
    runner = engine.executor.runner  # the uni executor's, in this process
    clock = PhaseClock()
    rng = np.random.default_rng(seed)
    vocab = runner.vocab_size
    requests: dict[str, StreamedRequest] = {}
    for i in range(rows):
        request_id = f"r{rows}-{i}"
        prompt = rng.integers(1000, vocab - 1000, PROMPT_LEN).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        requests[request_id] = StreamedRequest(llm, request_id, prompt, params)
        engine.add_request(
            EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling_params=params,
                eos_token_id=None,
                arrival_time=time.time(),
            )
        )

    def serve_outputs(outputs: list[EngineCoreOutput]) -> None:
        payload = clock.timed(
            "messages", lambda: message_encoder.encode(EngineCoreOutputs(outputs=outputs))
        )
        received = clock.timed("messages", lambda: outputs_decoder.decode(payload).outputs)
        deltas = []
        with_detokenize = time.perf_counter()
        for output in received:
            request = requests[output.request_id]
            deltas.append((request, detokenize_output(request.detokenizer, request.params, output)))
        clock.seconds["detokenize"] += time.perf_counter() - with_detokenize
        with_sse = time.perf_counter()
        for request, delta in deltas:
            sse_chunk(request, delta.text, delta.finish_reason)
        clock.seconds["sse"] += time.perf_counter() - with_sse

    # Prefill every prompt (and a first decode step) before the clock starts.
    while engine.scheduler.stats().num_waiting or any(
        len(r.output_token_ids) < 2 for r in engine.scheduler.running
    ):
        outputs, _ = engine.step()
        serve_outputs(outputs)
    clock.seconds.clear()
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.scheduler, "update_from_output", "update")
    clock.wrap(runner, "execute_model", "execute")
    clock.wrap(runner, "sample_tokens", "sampling")
    clock.wrap(runner.model, "forward", "forward")
    clock.wrap(runner.model, "compute_logits", "forward")
    started = time.perf_counter()
    for _ in range(steps):
        outputs, _ = engine.step()
        if len(outputs) != rows:
            raise RuntimeError(f"a step at {rows} rows gave {len(outputs)} outputs")
        serve_outputs(outputs)
    total = time.perf_counter() - started
    for owner, attribute in (
        (engine.scheduler, "schedule"),
        (engine.scheduler, "update_from_output"),
        (runner, "execute_model"),
        (runner, "sample_tokens"),
        (runner.model, "forward"),
        (runner.model, "compute_logits"),
    ):
        delattr(owner, attribute)  # the class's method again
    engine.abort_requests(list(requests))
    engine.step()  # lets the runner drop the aborted rows
    seconds = dict(clock.seconds)
    seconds["inputs"] = seconds.pop("execute") - seconds["forward"]
    seconds["other"] = total - sum(seconds.values())
    per_step = {phase: 1e3 * seconds.get(phase, 0.0) / steps for phase in PHASES}
    per_step["total"] = 1e3 * total / steps
    per_step["host"] = per_step["total"] - per_step["forward"]
    return per_step


def measure_phases(rows_list: list[int], steps: int) -> dict[int, dict[str, float]]:
    folder = overhead_model()
    llm = LLM(
        str(folder),
        dtype="float32",
        max_num_seqs=max(rows_list),
        max_num_batched_tokens=max(2048, max(rows_list) * PROMPT_LEN),
        enable_prefix_caching=False,
    )
    measure_rows(llm, max(rows_list), 8, seed=0)  # warm-up: allocations, first calls
    return {rows: measure_rows(llm, rows, steps, seed=rows) for rows in rows_list}


def phases_table(results: dict[int, dict[str, float]]) -> str:
    columns = [*PHASES, "host", "total"]
    lines = [
        "| rows | " + " | ".join(columns) + " | host µs/row |",
        "|---|" + "---|" * (len(columns) + 1),
    ]
    for rows, per_step in results.items():
        cells = [f"{per_step[c]:.3f}" for c in columns]
        lines.append(
            f"| {rows} | " + " | ".join(cells) + f" | {1e3 * per_step['host'] / rows:.1f} |"
        )
    return "\n".join(lines)


# -- served ------------------------------------------------------------------------------


def served(args: argparse.Namespace, out_dir: Path) -> list[dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).parent))
    import against_peers
    from serving import check_alive, running_announced

    from plugserve.bench.plugserve_server import PlugserveServer

    folder = overhead_model()
    input_len, output_len = SERVED_LEN
    results = []
    systems = ["plugserve"]
    if (against_peers.ANCHORS / "venv-vllm" / "bin" / "vllm").is_file():
        systems.append("vllm")
    else:
        print(
            f"vLLM's CPU build is not set up in {against_peers.ANCHORS}: plugserve alone "
            f"({args.peers_dir}/README.md sets it up)",
            flush=True,
        )
    for system in systems:
        if system == "plugserve":
            server = PlugserveServer(
                out_dir / "server-plugserve.log",
                settings=[
                    "--model",
                    str(folder),
                    "--dtype",
                    "float32",
                    "--max-num-seqs",
                    str(max(SERVED_CONCURRENCY)),
                    "--enable-prefix-caching",
                    "false",
                ],
            )
        else:
            cores = os.cpu_count() or 1
            env = {
                "MODEL": str(folder),
                "DTYPE": "float32",
                "MAX_NUM_SEQS": str(max(SERVED_CONCURRENCY)),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
            }
            server = against_peers.peer_server(system, args.peers_dir / "run_vllm.sh", env, out_dir)
        with running_announced(server, args.startup_timeout, check_exit=system == "plugserve"):
            for conc in SERVED_CONCURRENCY:
                label = f"overhead-{system}"
                path = out_dir / f"{label}-c{conc}.json"
                path.unlink(missing_ok=True)
                extra = ["--input-len", str(input_len), "--output-len", str(output_len)]
                extra += ["--result-dir", str(out_dir)]
                env = {
                    **os.environ,
                    "ANCHORS": str(against_peers.ANCHORS),
                    "MODEL_NAME": against_peers.served_model(server.base_url),
                    "TOKENIZER": str(folder),
                    "SEED": str(conc),
                    "N": str(max(64, 2 * conc)),
                    "N_FOR_C1": "16",
                    "BENCH_EXTRA_ARGS": " ".join(extra),
                }
                cmd = ["bash", str(args.peers_dir / "bench.sh"), label, server.base_url, str(conc)]
                subprocess.run(cmd, env=env, check=False)
                if not path.is_file():
                    raise RuntimeError(f"bench.sh wrote no {path}")
                raw = json.loads(path.read_text())
                results.append(
                    {
                        "system": system,
                        "concurrency": conc,
                        "output_throughput": raw["output_throughput"],
                        "median_itl_ms": raw["median_itl_ms"],
                        "median_ttft_ms": raw["median_ttft_ms"],
                    }
                )
                check_alive(server)
    return results


def served_table(results: list[dict[str, Any]]) -> str:
    by = {(r["system"], r["concurrency"]): r for r in results}
    lines = [
        "| c | plugserve tok/s | vLLM tok/s | ratio | plugserve ITL p50 ms | vLLM ITL p50 ms |"
    ]
    lines.append("|---|---|---|---|---|---|")
    for conc in SERVED_CONCURRENCY:
        ours, theirs = by.get(("plugserve", conc)), by.get(("vllm", conc))
        if ours is None or theirs is None:
            continue
        ratio = ours["output_throughput"] / theirs["output_throughput"]
        lines.append(
            f"| {conc} | {ours['output_throughput']:.0f} | {theirs['output_throughput']:.0f} | "
            f"{ratio:.2f}x | {ours['median_itl_ms']:.2f} | {theirs['median_itl_ms']:.2f} |"
        )
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                amx = "with AMX" if "amx_bf16" in flags else "no AMX"
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs, {amx})"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help="phases (the default), served")
    parser.add_argument("--rows", default="1 64 256")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument(
        "--peers-dir",
        type=Path,
        default=Path(__file__).resolve().parents[1].parent / "shared" / "peers",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.parts = args.parts or ["phases"]
    if unknown := set(args.parts) - {"phases", "served"}:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))} (phases, served)")
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_name(),
        "torch_threads": torch.get_num_threads(),
    }
    print(f"CPU: {report['cpu']}; torch threads {report['torch_threads']}", flush=True)
    if "phases" in args.parts:
        rows = [int(r) for r in args.rows.split()]
        phases = measure_phases(rows, args.steps)
        report["phases"] = phases
        print("\nms per decode step, by phase (in process):\n" + phases_table(phases), flush=True)
        ratio = phases[max(rows)]["host"] / phases[min(rows)]["host"]
        print(
            f"host time at {max(rows)} rows is {ratio:.1f}x that at {min(rows)} "
            f"({max(rows) // min(rows)}x the rows)"
        )
    if "served" in args.parts:
        out_dir = cache_root() / "bench" / "engine_overhead"
        out_dir.mkdir(parents=True, exist_ok=True)
        results = served(args, out_dir)
        report["served"] = results
        print("\nserved, vLLM's client, 128 in / 128 out:\n" + served_table(results))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
