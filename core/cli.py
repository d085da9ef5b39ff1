"""`plugserve` command line: plugins | models | config | serve | bench serve | bench kernels.

Any setting can be overridden after the subcommand as `--dotted.path value` or, when
unambiguous, `--leaf-name value` (`--stack.scheduler priority`, `--max-num-seqs 8`).
Errors print one line and exit 2. `bench serve` takes only its own flags (see
plugserve.bench).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import yaml

from plugserve.bench import add_cli_args
from plugserve.bench import main as bench_main
from plugserve.config import load_config
from plugserve.ops.process_env import adopt_engine_environment
from plugserve.plugins import SLOT_HOOKS, PluginError, get_registry
from plugserve.process_exit import exit_now


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`--key value` / `--key=value` pairs → {key: typed value}; values read as YAML
    scalars so that numbers and booleans keep their type."""
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ValueError(f"unexpected argument {arg!r}; settings are given as --name value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ValueError(f"setting --{key} needs a value")
            value = args[i + 1]
            i += 1
        overrides[key.replace("-", "_")] = yaml.safe_load(value) if value != "" else ""
        i += 1
    return overrides


def cmd_plugins(_args: argparse.Namespace, _overrides: dict[str, Any]) -> int:
    registry = get_registry()
    rows = {slot: list(registry.implementations(slot).values()) for slot in SLOT_HOOKS}
    impls = [impl for slot_impls in rows.values() for impl in slot_impls]
    name_width = max((len(i.name) for i in impls), default=4)
    dist_width = max((len(i.distribution) for i in impls), default=12)
    for slot, slot_impls in rows.items():
        print(f"{slot}:")
        if not slot_impls:
            print("  (none)")
        for impl in slot_impls:
            where = f"{impl.cls.__module__}.{impl.cls.__qualname__}"
            print(f"  {impl.name:<{name_width}}  {impl.distribution:<{dist_width}}  {where}")
    return 0


def cmd_models(_args: argparse.Namespace, _overrides: dict[str, Any]) -> int:
    """The registered model architectures (config.json `architectures` names), the
    distribution registering each and where its class lives, imported by none."""
    impls = sorted(get_registry().implementations("model").values(), key=lambda i: i.name)
    name_width = max([len("architecture"), *(len(i.name) for i in impls)])
    dist_width = max([len("distribution"), *(len(i.distribution) for i in impls)])
    print(f"{'architecture':<{name_width}}  {'distribution':<{dist_width}}  class")
    for impl in impls:
        print(f"{impl.name:<{name_width}}  {impl.distribution:<{dist_width}}  {impl.reference}")
    return 0


def cmd_config(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    config = load_config(args.config, overrides)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def cmd_serve(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    # Before torch loads OpenMP: the engines are forked from this process.
    adopt_engine_environment()
    config = load_config(args.config, overrides)
    from plugserve.frontend.serve import serve

    # Once served, every process this one started has exited: no teardown to wait for.
    exit_now(serve(config))


def cmd_bench_serve(args: argparse.Namespace, _overrides: dict[str, Any]) -> int:
    return bench_main(args)


def cmd_bench_kernels(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """Time every kernel of the model's linear method on the model's own matmuls, per row
    bucket, now (not from the cache), print the table, and keep the plan for this machine:
    what an engine then runs (capabilities.HasKernelPlan: the bf16 CPU kernels)."""
    import torch

    from plugserve.capabilities import REMEASURE_KERNELS_ENV, has_kernel_plan
    from plugserve.llm import LLM
    from plugserve.worker.linear_methods import linear_methods_of

    os.environ[REMEASURE_KERNELS_ENV] = "1"  # this process's engine measures, whatever is cached
    settings = {"dtype": "bfloat16", "kv_cache_memory": "32MiB", **overrides}
    llm = LLM(config=args.config, **settings)
    methods = linear_methods_of(llm.engine.executor.runner.model)
    measurements = (m.kernel_measurement for m in methods if has_kernel_plan(m))
    measurement = next((m for m in measurements if m is not None), None)
    if measurement is None:
        raise ValueError("this model and machine run no measured kernel plan: nothing to time")
    print(
        f"CPU: {measurement.cpu_model()}; {torch.get_num_threads()} threads; "
        f"model {llm.config.model}"
    )
    print(measurement.describe())
    print(measurement.table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plugserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plugins", help="list every slot, its implementations and their distribution"
    )
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser(
        "models", help="list the registered model architectures and their distribution"
    )
    p.set_defaults(func=cmd_models)
    for name, func, text in (
        ("config", cmd_config, "print the resolved configuration"),
        ("serve", cmd_serve, "serve the OpenAI-compatible API (settings as --name value)"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", "-c", default=None, help="stack.yaml path")
        p.set_defaults(func=func)
    p = sub.add_parser("bench", help="benchmark a running OpenAI-compatible server")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser(
        "serve", help="online serving benchmark, as `vllm bench serve` (its own flags)"
    )
    add_cli_args(p).set_defaults(func=cmd_bench_serve)
    p = bench_sub.add_parser(
        "kernels",
        help="time the bf16 CPU matmul kernels on a model, per row bucket (settings as "
        "--name value, e.g. --model, --num-threads)",
    )
    p.add_argument("--config", "-c", default=None, help="stack.yaml path")
    p.set_defaults(func=cmd_bench_kernels)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench" and args.bench_command == "serve" and rest:
        parser.parse_args(argv)  # not settings but unknown flags: argparse's error, exit 2
    try:
        overrides = parse_overrides(rest)
        if overrides and args.command in ("plugins", "models"):
            raise ValueError(f"plugserve {args.command} takes no settings")
        return args.func(args, overrides)
    except (ValueError, PluginError) as exc:
        print(f"plugserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
