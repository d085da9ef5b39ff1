"""What each parallelism costs in messages per step on this machine, from the executors'
own counters (capabilities.CountsMessages): per batch (an engine step; with pipeline
stages, one batch through every stage), the commands the engine sends its ranks and the
replies it gets back, the collectives among a stage's ranks (one per rank per call) and
the sends from a stage to the next, with their bytes. Counts, not timings: the machine's
load does not change them.

Each configuration decodes `--concurrency` requests of `--input-len` prompt tokens twice,
to 2 and to 2 + `--decode-steps` new tokens; the difference between the two runs is the
cost of the decode steps alone, divided by their batches. A data-parallel engine costs
what its own executor costs (the `TP=1` row for mp); engines exchange nothing.

What data parallelism adds is on the transport, between the API server and the engines:
`--served` measures it the same way through `plugserve serve` with one engine and with
two (/metrics: plugserve_engine_messages_total and _message_bytes_total by direction,
per engine step).

    .venv/bin/python benchmarks/messages_per_step.py [--ray] [--served] [--concurrency 8]

`--ray` adds the Ray executor's rows, on a local two-node Ray cluster started here.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from plugserve import LLM, SamplingParams
from plugserve.bench.plugserve_server import PlugserveServer
from plugserve.capabilities import counts_messages
from plugserve.datatypes import MessageCounts

CONFIGS: dict[str, dict[str, Any]] = {
    "mp, TP=1 (each engine of DP=2)": dict(executor="mp"),
    "mp, TP=2": dict(executor="mp", tensor_parallel_size=2),
    "mp, PP=2": dict(executor="mp", pipeline_parallel_size=2),
    "mp, TP=2 x PP=2": dict(executor="mp", tensor_parallel_size=2, pipeline_parallel_size=2),
}
RAY_CONFIGS: dict[str, dict[str, Any]] = {
    "ray, TP=2": dict(executor="ray", tensor_parallel_size=2),
    "ray, PP=2": dict(executor="ray", pipeline_parallel_size=2),
}


def decode_counts(engine: dict[str, Any], args: argparse.Namespace) -> MessageCounts:
    """The counts of `args.decode_steps` decode steps of `args.concurrency` requests."""
    llm = LLM(
        dtype="float32",
        num_threads=1,
        kv_cache_memory="64MiB",
        max_num_seqs=args.concurrency,
        **engine,
    )
    try:
        executor = llm.engine.executor
        assert counts_messages(executor), f"{type(executor).__name__} counts no messages"
        runs = []
        for run, new_tokens in enumerate((2, 2 + args.decode_steps)):
            prompts = [{"prompt_token_ids": prompt(args, run, i)} for i in range(args.concurrency)]
            before = executor.message_counts()
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
            llm.generate(prompts, params)
            runs.append(executor.message_counts() - before)
        return runs[1] - runs[0]
    finally:
        llm.engine.shutdown()


SERVED = {"DP=1 (uni)": [], "DP=2 (uni)": ["--data-parallel-size", "2"]}
TRANSPORT_FIGURES = ("to_engine", "from_engine")


def served_counts(settings: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Messages and bytes each way between the API server and the engines, per engine
    step, over `args.decode_steps` decode steps of `args.concurrency` requests."""
    with tempfile.TemporaryDirectory() as folder:
        server = PlugserveServer(
            Path(folder) / "server.log",
            transport="zmq",
            settings=[
                "--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "64MiB",
                "--max-num-seqs", str(args.concurrency), *settings,
            ],
        )  # fmt: skip
        with server.running():
            runs = []
            for run, new_tokens in enumerate((2, 2 + args.decode_steps)):
                before = server.wait_idle()
                asyncio.run(_complete(server, args, run, new_tokens))
                after = server.wait_idle()
                runs.append({k: after.get(k, 0.0) - before.get(k, 0.0) for k in after})
    decode = {k: runs[1][k] - runs[0].get(k, 0.0) for k in runs[1]}
    steps = decode["engine_steps_total"]
    figures = {}
    for direction in TRANSPORT_FIGURES:
        for name in ("engine_messages_total", "engine_message_bytes_total"):
            total = sum(
                v for k, v in decode.items() if k.startswith(name) and f'"{direction}"' in k
            )
            figures[f"{name} {direction}"] = total / steps
    return figures


def prompt(args: argparse.Namespace, run: int, index: int) -> list[int]:
    """Request `index`'s prompt in run `run`: no two share a prefix, so that the prefix
    cache leaves both runs the same prefill."""
    first = 1000 + (run * args.concurrency + index) * args.input_len
    return list(range(first, first + args.input_len))


async def _complete(
    server: PlugserveServer, args: argparse.Namespace, run: int, new_tokens: int
) -> None:
    async with server.async_openai_client() as client:
        await asyncio.gather(
            *(
                client.completions.create(
                    model="smollm2-135m-instruct",
                    prompt=prompt(args, run, i),
                    max_tokens=new_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for i in range(args.concurrency)
            )
        )


def row(name: str, counts: MessageCounts) -> str:
    per = [getattr(counts, f) / counts.batches for f in MessageCounts.__struct_fields__[1:]]
    return f"| {name} | " + " | ".join(f"{v:,.1f}" for v in per) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--ray", action="store_true")
    parser.add_argument("--served", action="store_true")
    parser.add_argument("--skip-executors", action="store_true")
    args = parser.parse_args()
    configs = dict(CONFIGS)
    cluster = None
    if args.ray:
        import ray
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        configs.update(RAY_CONFIGS)
    print(
        f"SmolLM2-135M fp32, {args.concurrency} requests, per decode batch "
        f"(mean over {args.decode_steps} decode steps' batches)"
    )
    names = [f.replace("_", " ") for f in MessageCounts.__struct_fields__[1:]]
    print("| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    try:
        for name, engine in configs.items() if not args.skip_executors else ():
            counts = decode_counts(engine, args)
            print(row(f"{name} ({counts.batches} batches)", counts), flush=True)
        if args.served:
            print("\nper engine step, between the API server and the engines")
            print("| | messages to | bytes to | messages from | bytes from |")
            print("|---|---|---|---|---|")
            for name, settings in SERVED.items():
                f = served_counts(settings, args)
                print(
                    f"| {name} | {f['engine_messages_total to_engine']:.2f} "
                    f"| {f['engine_message_bytes_total to_engine']:,.0f} "
                    f"| {f['engine_messages_total from_engine']:.2f} "
                    f"| {f['engine_message_bytes_total from_engine']:,.0f} |",
                    flush=True,
                )
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()


if __name__ == "__main__":
    main()
