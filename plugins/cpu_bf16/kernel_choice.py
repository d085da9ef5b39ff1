"""A model's bf16 CPU kernel plan, chosen by timing the candidates on its own weights.

For each row bucket (kernel_plan.ROW_BUCKETS) every candidate kernel runs the matmuls of
one step of the model (each layer's projections and its gated MLP, the LM head in the
decode buckets) over the model's real weights, in step order, so that the weights stream
from memory as in serving. Candidates take turns round by round, so that a shift in the
machine's memory speed (a shared VM's bandwidth changes phase within seconds) reaches all
of them alike; each one's median wins or loses. A model bigger than MEASURED_BYTES is
timed on its first layers up to that size. A decode bucket's runs repeat its row count, as
a batch's size recurs step after step; each run in a prefill bucket takes a row count not
run before, as prompts of varying length do (kernels that build code per shape pay for it
there, as they do in serving).

The plan is kept per machine and model shape (CPU model and flags, threads, torch and
kernel sources, the matmul shapes) under the plugserve cache dir, so an engine measures
once; PLUGSERVE_REMEASURE_KERNELS=1 or `plugserve bench kernels` measures again. A plan
timed while processes outside this server took a share of the CPUs (a test run, another
server, the hypervisor's steal) is used by the engine that measured it but not kept: its
timings are the other process's as much as the kernels'.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from plugserve import ops
from plugserve.capabilities import REMEASURE_KERNELS_ENV
from plugserve.ops.build import cache_key as source_key
from plugserve.ops.kernel_timing import (
    ONE_ROW,
    cpu_model_name,
    is_prefill,
    leading,
    median_ms_in_turns,
    plan_digest,
    shapes_digest,
)
from plugserve.user_cache import cache_root
from plugserve_plugins.cpu_bf16.cpu_features import (
    FMA_GEMM_SOURCE,
    GEMM_SOURCE,
    amx_available,
    own_kernel_unavailable_reason,
    release_row_pool_inputs,
)
from plugserve_plugins.cpu_bf16.cpu_usage import cpu_usage, others_share
from plugserve_plugins.cpu_bf16.fused_mlp import FusedMLP
from plugserve_plugins.cpu_bf16.kernel_plan import (
    AMX,
    BATCH_INVARIANT_KERNELS,
    KERNELS,
    KERNELS_BY_NAME,
    ROW_BUCKETS,
    Kernel,
    KernelPlan,
    candidates_for,
)
from plugserve_plugins.cpu_bf16.kernel_setting import KERNEL_ENV, allowed_libraries, forced_plan
from plugserve_plugins.cpu_bf16.packed_linear import PackedLinear
from plugserve_plugins.cpu_bf16.plan_rules import (
    LOSER_FACTOR,
    choose,
    choose_single,
    is_batch_invariant,
)
from plugserve_plugins.cpu_bf16.weight_arena import WeightArena

logger = logging.getLogger(__name__)

# Timed on at most this many bytes of bf16 weights (a step's leading layers).
MEASURED_BYTES = 768 * 2**20
# Rounds per bucket: every candidate once a round; the median over rounds counts.
DECODE_ROUNDS, PREFILL_ROUNDS = 7, 3
_PLAN_FORMAT = 3  # 3: prefill buckets timed on fresh row counts
# Above this share of the machine's CPU time taken by processes outside this server's
# process group while the candidates ran, a plan is not kept: beside a test run the
# timings are the other processes' as much as the kernels', and buckets flip; a quiet
# machine's own noise stays well below it (docs/benchmarks-history.md, "bf16 CPU kernels
# by row count").
CONTENDED_SHARE = 0.15


@dataclass(frozen=True)
class LinearStep:
    """One matmul of a step: weight [out, in] as loaded; `head`: the LM head (fp32 out)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    head: bool = False


@dataclass(frozen=True)
class GatedMlpStep:
    """down(silu(gate) * up) with gate and up stacked in one weight, as GatedMLP holds them."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


Step = LinearStep | GatedMlpStep


@dataclass
class Measurement:
    """Per bucket, each candidate's median milliseconds for a step's matmuls
    (capabilities.KernelMeasurement)."""

    plan: KernelPlan
    times_ms: list[dict[str, float | None]]
    rounds: list[int]
    measured_bytes: int
    total_bytes: int
    key: dict[str, object] = field(default_factory=dict)
    cache_file: Path | None = None
    from_cache: bool = False
    # The share of the machine's CPU time that processes outside this server's process
    # group (and the hypervisor) took while the candidates ran; None where unknown.
    others_share: float | None = None

    @property
    def contended(self) -> bool:
        return self.others_share is not None and self.others_share > CONTENDED_SHARE

    def cpu_model(self) -> str:
        return str(self.key.get("cpu") or cpu_model_name())

    def describe(self) -> str:
        lines = [
            f"ms for one step's matmuls ({self.measured_bytes / 2**20:.0f} of "
            f"{self.total_bytes / 2**20:.0f} MiB of weights), median of "
            f"{', '.join(map(str, self.rounds))} rounds by bucket; * chosen",
            f"plan: {self.plan.describe()}",
        ]
        if self.cache_file is not None:
            lines.append(f"kept in {self.cache_file}")
        elif self.contended:
            lines.append("not kept (timed beside other work: the next start times it again)")
        if self.contended and self.others_share is not None:
            lines.append(
                f"other processes took {100 * self.others_share:.0f}% of the CPUs while "
                "it was timed; measure again on a quiet machine for a plan of this one alone"
            )
        return "\n".join(lines)

    def table(self) -> str:
        """A markdown table: buckets down, candidates across, the chosen time starred. A
        prefill bucket is measured "from" its row count: a new count each run (run_rows)."""
        names = [k.name for k in KERNELS if any(k.name in t for t in self.times_ms)]
        lines = [
            "| rows | measured at | chosen | " + " | ".join(names) + " |",
            "|---|---|---|" + "---|" * len(names),
        ]
        for b, (bucket, times, chosen) in enumerate(
            zip(ROW_BUCKETS, self.times_ms, self.plan.by_bucket, strict=True)
        ):
            cells = [_cell(times, n, chosen.name) for n in names]
            measured = f"from {bucket.measured_rows}" if is_prefill(b) else bucket.measured_rows
            lines.append(
                f"| {bucket.name} | {measured} | {chosen.name} | " + " | ".join(cells) + " |"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        return {
            "format": _PLAN_FORMAT,
            "key": self.key,
            "plan": [kernel.name for kernel in self.plan.by_bucket],
            "times_ms": self.times_ms,
            "rounds": self.rounds,
            "measured_bytes": self.measured_bytes,
            "total_bytes": self.total_bytes,
            "others_share": self.others_share,
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        }

    @classmethod
    def from_json(cls, data: dict, cache_file: Path) -> Measurement:
        return cls(
            plan=KernelPlan(tuple(KERNELS_BY_NAME[name] for name in data["plan"])),
            times_ms=data["times_ms"],
            rounds=data["rounds"],
            measured_bytes=data["measured_bytes"],
            total_bytes=data["total_bytes"],
            key=data["key"],
            cache_file=cache_file,
            from_cache=True,
            others_share=data.get("others_share"),
        )


def _cell(times: dict[str, float | None], name: str, chosen: str) -> str:
    if name not in times:
        return "—"
    ms = times[name]
    mark = "*" if name == chosen else ""
    return ("kept, untimed" if ms is None else f"{ms:.2f}") + mark


def plan_for(
    steps: Sequence[Step],
    *,
    coded: bool = False,
    remeasure: bool | None = None,
    batch_invariant: bool = False,
    layout_gain: float = 0.0,
) -> Measurement:
    """The plan for a model whose step runs `steps`, from its candidates' times: those
    cached for this machine and shape, else measured now (and cached). `coded`: one-row
    matmuls may read exponent-coded copies of the weights. Where each bucket has one
    candidate (a single library allowed), that one, unmeasured. `batch_invariant`: one
    kernel of BATCH_INVARIANT_KERNELS for every bucket (choose_single), a ValueError where
    none runs here; else `layout_gain`: the least gain a further copy of the weights must
    bring the buckets that read it (choose)."""
    candidates = batch_invariant_candidates() if batch_invariant else candidates_here(coded)
    total = sum(_step_bytes(step) for step in steps)
    forced = forced_plan()
    if forced is not None and batch_invariant and not is_batch_invariant(forced):
        raise ValueError(
            f"engine.batch_invariant needs one kernel of "
            f"{', '.join(k.name for k in BATCH_INVARIANT_KERNELS)} for every row count; "
            f"{KERNEL_ENV} sets {forced.describe()}"
        )
    if forced is not None or all(len(c) == 1 for c in candidates):
        plan = forced or KernelPlan(tuple(c[0] for c in candidates))
        return Measurement(plan, [{} for _ in ROW_BUCKETS], [0] * len(ROW_BUCKETS), 0, total)
    key = _cache_key(steps, candidates)
    path = cache_root() / "kernel_plans" / f"{plan_digest(key)}.json"

    def plan_of(measurement: Measurement) -> Measurement:
        times = measurement.times_ms
        measurement.plan = (
            choose_single(times, candidates[0])
            if batch_invariant
            else choose(times, candidates, layout_gain)
        )
        return measurement

    if remeasure is None:
        remeasure = os.environ.get(REMEASURE_KERNELS_ENV, "") not in ("", "0")
    if not remeasure and path.exists():
        try:
            return plan_of(Measurement.from_json(json.loads(path.read_text()), path))
        except (KeyError, ValueError, TypeError) as exc:
            logger.warning("ignoring unreadable kernel plan %s: %s", path, exc)
    measurement = plan_of(measure(steps, candidates))
    measurement.key = key
    # A plan timed at start-up beside other work is used, not kept: the next start times
    # it again. One measured on request (`plugserve bench kernels`) is kept all the same:
    # the user asked for this plan, and its table says the machine was busy.
    if measurement.contended and not remeasure:
        logger.warning(
            "other processes took %.0f%% of the CPUs while the kernels were timed: this "
            "engine follows the plan, but it is not kept (the next start measures again)",
            100 * measurement.others_share,
        )
        return measurement
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(measurement.to_json(), indent=1))
    tmp.replace(path)  # atomic: engines starting together read a whole file
    measurement.cache_file = path
    return measurement


def candidates_here(coded: bool) -> list[list[Kernel]]:
    """Per ROW_BUCKETS bucket, the kernels a plan may give it on this machine: those of the
    allowed libraries (kernel_setting.allowed_libraries), coded ones where `coded` allows them,
    AMX tiles where cpu_gemm.cpp runs them here. Every consumer of a plan must run each."""
    libraries = allowed_libraries()
    coded = coded and "own" in libraries
    amx = "own" in libraries and amx_available()
    return [candidates_for(b, libraries, coded, amx) for b in range(len(ROW_BUCKETS))]


def batch_invariant_candidates() -> list[list[Kernel]]:
    """Per bucket, the BATCH_INVARIANT_KERNELS that run here (the same for every bucket);
    a ValueError naming why where none does (cpu_gemm.cpp needs AVX512_BF16)."""
    libraries = allowed_libraries()
    if "own" not in libraries:
        reason = own_kernel_unavailable_reason() or f"{KERNEL_ENV} leaves it out"
        raise ValueError(
            "engine.batch_invariant needs cpu_gemm.cpp's tile kernels for bf16 linears, "
            f"which cannot run here: {reason}"
        )
    amx = amx_available()
    kernels = [k for k in BATCH_INVARIANT_KERNELS if k.one_row_mode != AMX or amx]
    return [list(kernels) for _ in ROW_BUCKETS]


def measure(steps: Sequence[Step], candidates: list[list[Kernel]]) -> Measurement:
    """Time candidates[b] for each bucket b on `steps` (their leading MEASURED_BYTES) and
    choose each bucket's fastest."""
    # The steps up to MEASURED_BYTES, plus the head where it fits.
    measured = leading(steps, _step_bytes, MEASURED_BYTES)
    kernels = {k for bucket in candidates for k in bucket}
    bench = _StepBench(measured, kernels)
    before = cpu_usage()
    times = time_candidates(bench.run, candidates)
    after = cpu_usage()
    release_row_pool_inputs()  # the bench's weights go when it returns
    plan = choose(times, candidates)
    rounds = [_rounds(b) for b in range(len(ROW_BUCKETS))]
    return Measurement(
        plan,
        times,
        rounds,
        sum(_step_bytes(s) for s in measured),
        sum(_step_bytes(s) for s in steps),
        others_share=others_share(before, after),
    )


def time_candidates(
    run: Callable[[Kernel, int, int], None],
    candidates: list[list[Kernel]],
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict[str, float | None]]:
    """Per bucket, each candidate's median milliseconds of run(kernel, rows, bucket) over
    the bucket's rounds (kernel_timing.median_ms_in_turns), read off `clock` (seconds). A
    bucket with one candidate is not timed
    ({}); one where the others lost the bucket below by LOSER_FACTOR holds its survivor,
    untimed (None)."""
    if len(candidates) != len(ROW_BUCKETS):
        raise ValueError(f"{len(candidates)} candidate lists for {len(ROW_BUCKETS)} row buckets")
    times: list[dict[str, float | None]] = []
    losers: set[str] = set()  # far behind in the bucket below: not timed in this one
    for b, kernels in enumerate(candidates):
        if is_prefill(b):
            kernels = [k for k in kernels if k.name not in losers] or kernels
        if len(kernels) < 2:
            times.append({kernels[0].name: None} if losers else {})  # left alone, untimed
            continue
        rows = run_rows(b)

        def run_next(kernel: Kernel, rows: Iterator[int] = rows, bucket: int = b) -> None:
            run(kernel, next(rows), bucket)

        by_kernel = median_ms_in_turns(kernels, run_next, _rounds(b), clock)
        medians = {kernel.name: ms for kernel, ms in by_kernel.items()}
        times.append(dict(medians))
        if b != ONE_ROW:  # one row runs its own loops: no word on more rows
            best = min(medians.values())
            # Once left out, left out: a kernel behind at fewer rows stays behind at more.
            losers = {name for name in losers if name not in medians} | {
                name for name, ms in medians.items() if ms > LOSER_FACTOR * best
            }
    return times


def run_rows(bucket: int) -> Iterator[int]:
    """The row count of each run in a bucket, warm-ups included. A decode bucket repeats
    its measured count. A prefill bucket counts up from it, a new count each run: oneDNN
    builds (JIT-compiles) a primitive for each row count it has not seen, and serving's
    prompts rarely repeat a length; timed on one row count again and again, a kernel that
    builds per shape wins a bucket it then loses in serving (docs/benchmarks-history.md,
    "bf16 CPU kernels by row count")."""
    measured = ROW_BUCKETS[bucket].measured_rows
    return itertools.count(measured) if is_prefill(bucket) else itertools.repeat(measured)


def _rounds(bucket: int) -> int:
    return PREFILL_ROUNDS if is_prefill(bucket) else DECODE_ROUNDS


class _StepBench:
    """The measured steps with every candidate's layouts, run as a model step runs them."""

    def __init__(self, steps: Sequence[Step], kernels: set[Kernel]) -> None:
        plain = [s.weight for s in steps if isinstance(s, LinearStep)]
        plain += [w for s in steps if isinstance(s, GatedMlpStep) for w in (s.gate_up, s.down)]
        own = [k for k in kernels if k.library == "own"]
        arena = None
        if own:  # on huge pages as in serving; coded copies where a candidate reads them
            layout = next((k for k in own if k.coded), own[0])
            arena = WeightArena.for_weights(plain, KernelPlan.single(layout))
        self.calls: list[Callable[[Kernel, torch.Tensor], torch.Tensor]] = []
        self.inputs: list[int] = []  # each step's input width
        for step in steps:
            if isinstance(step, LinearStep):
                linear = PackedLinear(step.weight, step.bias, arena, kernels=kernels)
                out_dtype = torch.float32 if step.head else None
                self.calls.append(_linear_call(linear, out_dtype))
                self.inputs.append(step.weight.shape[1])
            else:
                self.calls.append(_mlp_call(step, arena, kernels))
                self.inputs.append(step.gate_up.shape[1])
        self.heads = [isinstance(s, LinearStep) and s.head for s in steps]
        self._x: dict[int, torch.Tensor] = {}

    def run(self, kernel: Kernel, rows: int, bucket: int) -> None:
        for call, width, head in zip(self.calls, self.inputs, self.heads, strict=True):
            if head and is_prefill(bucket):
                continue  # a prefill chunk's head runs on its few sampled rows
            call(kernel, self._input(rows, width))

    def _input(self, rows: int, width: int) -> torch.Tensor:
        # One tensor per width, its leading rows taken: a prefill bucket's runs each take a
        # new row count, and making their inputs (randn) would be timed with them. Made
        # with room for the bucket's further counts, in its untimed warm-up runs.
        x = self._x.get(width)
        if x is None or x.shape[0] < rows:
            generator = torch.Generator().manual_seed(width)
            x = torch.randn(rows + 64, width, generator=generator).to(torch.bfloat16)
            self._x[width] = x
        return x[:rows]


def _linear_call(
    linear: PackedLinear, out_dtype: torch.dtype | None
) -> Callable[[Kernel, torch.Tensor], torch.Tensor]:
    return lambda kernel, x: linear.run(kernel, x, out_dtype)


def _mlp_call(
    step: GatedMlpStep, arena: WeightArena | None, kernels: set[Kernel]
) -> Callable[[Kernel, torch.Tensor], torch.Tensor]:
    gate_up = PackedLinear(step.gate_up, step.gate_up_bias, arena, kernels=kernels)
    down = PackedLinear(step.down, step.down_bias, arena, kernels=kernels)
    inter = step.down.shape[1]
    fused = None
    if any(k.fused_mlp for k in kernels) and step.gate_up_bias is None:
        fused = FusedMLP.from_loaded(step.gate_up[:inter], step.gate_up[inter:], step.down)
    silu_and_mul = torch.ops.plugserve_ops.silu_and_mul if ops.load(ops.OPS_SOURCE) else None

    def run(kernel: Kernel, x: torch.Tensor) -> torch.Tensor:
        if kernel.fused_mlp and fused is not None:
            return fused(x)
        h = gate_up.run(kernel, x)
        if silu_and_mul is not None:
            activated = silu_and_mul(h)
        else:
            activated = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        return down.run(kernel, activated)

    return run


def _step_bytes(step: Step) -> int:
    if isinstance(step, LinearStep):
        return step.weight.numel() * step.weight.element_size()
    return (step.gate_up.numel() + step.down.numel()) * step.gate_up.element_size()


def _cache_key(steps: Sequence[Step], candidates: list[list[Kernel]]) -> dict[str, object]:
    """What the measurement depends on: the machine, the code, the model's matmul shapes."""
    shapes = [
        [list(s.weight.shape), s.bias is not None, s.head]
        if isinstance(s, LinearStep)
        else [list(s.gate_up.shape), list(s.down.shape), s.gate_up_bias is not None]
        for s in steps
    ]
    return {
        "cpu": cpu_model_name(),
        "flags": ops.cpu_flags(),
        "threads": torch.get_num_threads(),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", ""),
        "torch": torch.__version__,
        "kernels": source_key(GEMM_SOURCE) if "own" in allowed_libraries() else "",
        "fma_kernel": source_key(FMA_GEMM_SOURCE) if "fma" in allowed_libraries() else "",
        "candidates": [[k.name for k in bucket] for bucket in candidates],
        "shapes": shapes_digest(shapes),
        "layers": len(steps),
        "format": _PLAN_FORMAT,
    }
