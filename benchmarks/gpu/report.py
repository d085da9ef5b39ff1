"""The GPU check's verdict and table, from the parts the steps saved.

Writes results.json (everything) into the output folder and prints a short summary
with the throughput table last. Exit status 0 only when (a) and (b) passed and (c)
produced its rows.

    python benchmarks/gpu/report.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import common


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    parts = {
        name: common.load(name)
        for name in ("kernels", "greedy", "bandwidth", "plugserve_flashinfer", "hf")
    }
    (out / "results.json").write_text(json.dumps(parts, indent=2) + "\n")
    kernels, greedy = parts["kernels"], parts["greedy"]
    bandwidth, ours, theirs = parts["bandwidth"], parts["plugserve_flashinfer"], parts["hf"]

    def verdict(part: dict | None) -> str:
        return "not run" if part is None else ("PASS" if part["passed"] else "FAIL")

    print()
    print(f"(a) FlashInfer vs torch backend, random paged bf16 inputs: {verdict(kernels)}")
    if kernels:
        trials = kernels["trials"]
        worst = max(trials, key=lambda t: t["rel_err_flashinfer"])
        print(
            f"    worst relative error {worst['rel_err_flashinfer']:.2e} (torch bf16 on the "
            f"same case {worst['rel_err_torch_bf16']:.2e}); graph path vs eager at most "
            f"{max(t['rel_err_graph_vs_eager'] for t in trials):.2e}; "
            f"{len(trials)} trials, base seed {kernels['base_seed']}"
        )
    print(f"(b) greedy tokens, random 1B bf16, flashinfer stacks vs torch: {verdict(greedy)}")
    if greedy:
        for name, stack in greedy["stacks"].items():
            if stack.get("error"):
                print(f"    {name}: FAILED: {stack['error']}")
                continue
            ties = [s for s in stack["sequences"] if not s["identical"]]
            detail = "; ".join(
                f"token {s['position']} gap {s['gap_ref']:.3f}/{s['gap_cand']:.3f} "
                f"tol {s['tol']:.3f} {'tie' if s['accepted'] else 'NOT a tie'}"
                for s in ties
            )
            print(
                f"    {name}: {stack['identical']}/{greedy['prompts']} identical"
                + (f"; diverged: {detail}" if ties else "")
            )
    complete = bool(ours and theirs and bandwidth)
    print(
        f"(c) 8B-shaped bf16, {ours and len(ours['rows'])} batch sizes: {'reported' if complete else 'INCOMPLETE'}"
    )
    if ours and bandwidth:
        floor_ms = ours["weight_bytes"] / bandwidth["bytes_per_s"] * 1e3
        print(
            f"    {bandwidth['gpu']}: copy bandwidth {bandwidth['bytes_per_s'] / 1e12:.2f} TB/s; "
            f"a decode step reads {ours['weight_bytes'] / 1e9:.1f} GB of weights -> HBM floor "
            f"{floor_ms:.2f} ms; plugserve start-up {ours['startup_s']:.0f} s"
        )
        print()
        print(
            f"{'system':<24} {'batch':>5} {'tok/s':>9} {'step ms':>8} {'floor ms':>8} {'ratio':>6}"
        )
        for row in ours["rows"] + (theirs["rows"] if theirs else []):
            print(
                f"{row['system']:<24} {row['batch']:>5} {row['tokens_per_s']:>9.0f} "
                f"{row['decode_step_ms']:>8.2f} {floor_ms:>8.2f} "
                f"{row['decode_step_ms'] / floor_ms:>6.2f}"
            )
    passed = bool(kernels and kernels["passed"] and greedy and greedy["passed"] and complete)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
