"""W8A8 int8 matmuls on SmolLM2-135M's layer shapes, by row count: plugserve's own kernels
(int8_w8a8.cpp: AVX512-VNNI's one-row stream and register tiles, AMX-INT8 tiles) against what libraries offer (torch._int_mm,
oneDNN's qlinear_pointwise, torch.ao's dynamic quantized linear) and against bf16's
oneDNN matmul (docs/benchmarks.md, "int8 (W8A8)").

Each cell is the median milliseconds of one model step's matmuls: the 30 layers' qkv, o,
gate-up and down (distinct weights, so that a one-row step streams them from memory as
in serving), and at up to 8 rows the tied LM head; every int8 candidate quantizes its
activations on the fly inside the timing (per token for ours and torch._int_mm's, per
tensor for oneDNN's qlinear_pointwise, which takes one scale; torch.ao's per tensor too).

    .venv/bin/python benchmarks/w8a8_kernels.py [--rows 1 2 4 8 128 512 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F

from plugserve_plugins.linear_methods import w8a8_plan
from plugserve_plugins.linear_methods.int8_w8a8 import Int8W8A8
from plugserve_plugins.linear_methods.int8_weight_only import quantize_rows

LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD = (49152, 576)

Matmul = Callable[[torch.Tensor], torch.Tensor]


def shapes(rows: int) -> list[tuple[int, int]]:
    return LAYER_SHAPES * LAYERS + ([HEAD] if rows <= 8 else [])


def own(kernel: str, weights: list[torch.Tensor]) -> list[Matmul]:
    method = Int8W8A8()
    linears = [method.quantize(w) for w in weights]
    return [lambda x, linear=linear: linear.run(kernel, x) for linear in linears]


def onednn_qlinear(weights: list[torch.Tensor]) -> list[Matmul]:
    calls = []
    for w in weights:
        q, scale = quantize_rows(w)
        packed = torch.ops.onednn.qlinear_prepack(q, None)
        zeros = torch.zeros_like(scale, dtype=torch.int64)

        def call(x: torch.Tensor, packed=packed, scale=scale, zeros=zeros) -> torch.Tensor:
            lo, hi = x.min().float().clamp(max=0), x.max().float().clamp(min=0)
            x_scale = ((hi - lo) / 255).clamp(min=1e-8)
            x_zero = torch.round(-lo / x_scale).to(torch.int64)
            qx = torch.clamp(torch.round(x.float() / x_scale) + x_zero, 0, 255).to(torch.uint8)
            return torch.ops.onednn.qlinear_pointwise.tensor(
                qx, x_scale, x_zero, packed, scale, zeros, None, 1.0, 0,
                torch.bfloat16, "none", [], "",
            )  # fmt: skip

        calls.append(call)
    return calls


def ao_dynamic(weights: list[torch.Tensor]) -> list[Matmul]:
    torch.backends.quantized.engine = "x86"
    calls = []
    for w in weights:
        _, scale = quantize_rows(w)
        qw = torch.quantize_per_channel(
            w.float(), scale.double(), torch.zeros(len(scale), dtype=torch.int64), 0, torch.qint8
        )
        packed = torch.ops.quantized.linear_prepack(qw, None)
        calls.append(
            lambda x, packed=packed: torch.ops.quantized.linear_dynamic(x.float(), packed, False)
        )
    return calls


def bf16(weights: list[torch.Tensor]) -> list[Matmul]:
    return [lambda x, w=w: F.linear(x, w) for w in weights]


CANDIDATES: dict[str, Callable[[list[torch.Tensor]], list[Matmul]]] = {
    "own/vnni": lambda ws: own(w8a8_plan.VNNI, ws),
    "own/vnni-tiled": lambda ws: own(w8a8_plan.VNNI_TILED, ws),
    "own/amx": lambda ws: own(w8a8_plan.AMX, ws),
    "int_mm": lambda ws: own(w8a8_plan.INT_MM, ws),
    "onednn qlinear": onednn_qlinear,
    "torch.ao dynamic": ao_dynamic,
    "bf16 F.linear": bf16,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 128, 512, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES))
    args = parser.parse_args()
    reason = Int8W8A8.unavailable_reason()
    if reason:
        raise SystemExit(f"the W8A8 kernel cannot run here: {reason}")
    available = set(w8a8_plan.candidates_here()[-1])
    torch.manual_seed(0)
    all_weights = [(torch.randn(*s) * 0.05).bfloat16() for s in shapes(1)]
    names = [n for n in args.candidates if n in CANDIDATES]
    built: dict[str, list[Matmul] | str] = {}
    for name in names:
        kernel = {"own/amx": w8a8_plan.AMX, "int_mm": w8a8_plan.INT_MM}.get(name)
        if kernel is not None and kernel not in available:
            built[name] = "not here"
            continue
        try:
            built[name] = CANDIDATES[name](all_weights)
        except Exception as exc:  # a library path this torch or CPU lacks
            built[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        "?",
    )
    print(
        f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print("| rows | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for rows in args.rows:
        count = len(shapes(rows))
        inputs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        samples: dict[str, list[float]] = {n: [] for n in names if not isinstance(built[n], str)}
        for round_index in range(args.rounds + 1):  # the first round untimed
            for name in samples:
                calls = built[name][:count]
                assert not isinstance(calls, str)
                start = time.perf_counter()
                with torch.inference_mode():
                    for call, (_, k) in zip(calls, shapes(rows), strict=True):
                        call(inputs[k])
                if round_index:
                    samples[name].append(1e3 * (time.perf_counter() - start))
        cells = [
            built[n] if isinstance(built[n], str) else f"{statistics.median(samples[n]):.2f}"
            for n in names
        ]
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
