"""The kernel plan: chosen by timing the candidates on the model's own matmuls, kept per
machine and model shape, and followed call by call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plugserve.capabilities import REMEASURE_KERNELS_ENV
from plugserve.ops.kernel_timing import is_prefill
from plugserve.user_cache import cache_root
from plugserve_plugins.cpu_bf16 import (
    cpu_features,
    cpu_usage,
    kernel_choice,
    kernel_setting,
    packed_linear,
    plan_rules,
)
from plugserve_plugins.cpu_bf16.kernel_plan import (
    KERNELS_BY_NAME,
    OWN_AMX,
    ROW_BUCKETS,
    Kernel,
    KernelPlan,
    candidates_for,
)

# Where only ATen runs bf16 matmuls there is nothing to choose; the tests of the choice's
# logic alone (a fake clock, /proc readings) run everywhere.
needs_a_choice = pytest.mark.skipif(
    not packed_linear.packing_supported(torch.bfloat16, torch.device("cpu")),
    reason="no packed bf16 kernel on this CPU",
)


def tiny_step(seed: int = 0, hidden: int = 64) -> list[kernel_choice.Step]:
    """Two layers of a tiny model's matmuls, and a tied head."""
    generator = torch.Generator().manual_seed(seed)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16)

    steps: list[kernel_choice.Step] = []
    for _ in range(2):
        steps.append(kernel_choice.LinearStep(weight(3 * hidden, hidden)))  # qkv
        steps.append(kernel_choice.LinearStep(weight(hidden, hidden)))  # o
        steps.append(
            kernel_choice.GatedMlpStep(weight(4 * hidden, hidden), weight(hidden, 2 * hidden))
        )
    steps.append(kernel_choice.LinearStep(weight(256, hidden), head=True))
    return steps


def all_candidates() -> list[list[Kernel]]:
    libraries = kernel_setting.allowed_libraries()
    return [candidates_for(b, libraries, coded=True) for b in range(len(ROW_BUCKETS))]


class FakeClock:
    """Seconds that pass only when a test says so: timings that cannot depend on the
    machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@needs_a_choice
def test_a_slowed_candidate_never_wins_whichever_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan follows the clock, not a preference: each candidate in turn made slower
    than the others (20 ms more a run, on a clock that moves only by what the runs add)
    loses every bucket it competes in. The kernels really run, on a tiny model's step;
    every kernel this machine offers, not only the suite's pinned plan's."""
    monkeypatch.delenv(kernel_setting.KERNEL_ENV, raising=False)
    candidates = all_candidates()
    bench = kernel_choice._StepBench(tiny_step(), {k for b in candidates for k in b})
    contested = {k for bucket in candidates if len(bucket) > 1 for k in bucket}
    assert len(contested) >= 2, "fewer than two kernels run here: nothing to choose"
    for slowed in contested:
        clock = FakeClock()

        def run(
            kernel: Kernel, rows: int, bucket: int, slowed: Kernel = slowed, clock=clock
        ) -> None:
            bench.run(kernel, rows, bucket)
            clock.advance(0.021 if kernel == slowed else 0.001)

        times = kernel_choice.time_candidates(run, candidates, clock)
        plan = plan_rules.choose(times, candidates)
        for bucket, chosen, bucket_times in zip(candidates, plan.by_bucket, times, strict=True):
            if len(bucket) > 1 and slowed in bucket:
                assert chosen != slowed
                timed = {n: ms for n, ms in bucket_times.items() if ms is not None}
                # Timed and slow, or left out after losing a smaller bucket.
                assert slowed.name not in timed or timed[slowed.name] == pytest.approx(21)
                if timed:
                    assert timed[chosen.name] == min(timed.values()) == pytest.approx(1)


def test_prefill_buckets_are_timed_on_row_counts_not_seen_before() -> None:
    """A prompt's length rarely repeats, a batch's size does: a kernel that builds code for
    each new row count (oneDNN's primitives) pays for it in every prefill run it is timed
    on, and in a decode bucket's warm-up only. Here a candidate twice as fast as its rival
    once it has seen a row count, 30 ms slower before, wins the decode buckets and loses
    the prefill ones; the counts stay inside their bucket."""
    steady, builds = KERNELS_BY_NAME["onednn"], KERNELS_BY_NAME["own"]
    candidates = [[steady, builds] for _ in ROW_BUCKETS]
    counts: dict[tuple[int, str], list[int]] = {}
    built: set[int] = set()
    clock = FakeClock()

    def run(kernel: Kernel, rows: int, bucket: int) -> None:
        counts.setdefault((bucket, kernel.name), []).append(rows)
        if kernel == steady:
            clock.advance(0.004)
        else:
            clock.advance(0.002 if rows in built else 0.032)
            built.add(rows)

    times = kernel_choice.time_candidates(run, candidates, clock)
    plan = plan_rules.choose(times, candidates)
    for b, bucket in enumerate(ROW_BUCKETS):
        # (A bucket where one is left, after the other lost the one below, is not run.)
        bucket_counts = counts.get((b, steady.name), []) + counts.get((b, builds.name), [])
        assert all(bucket.first <= n <= (bucket.last or n) for n in bucket_counts)
        if is_prefill(b):
            assert len(set(bucket_counts)) == len(bucket_counts)  # each run a new count
            assert plan.by_bucket[b] == steady
        else:
            assert set(bucket_counts) == {bucket.measured_rows}
            assert plan.by_bucket[b] == builds


@pytest.fixture
def plan_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty plugserve cache dir, with nothing set that forces a plan or a measurement."""
    monkeypatch.setenv("PLUGSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(REMEASURE_KERNELS_ENV, raising=False)
    monkeypatch.delenv(kernel_setting.KERNEL_ENV, raising=False)
    return tmp_path


@needs_a_choice
def test_the_plan_is_measured_once_per_machine_and_model_shape(
    monkeypatch: pytest.MonkeyPatch, plan_cache: Path
) -> None:
    # Kept whatever else runs on this machine meanwhile (the next test is about that).
    monkeypatch.setattr(kernel_choice, "CONTENDED_SHARE", 1.0)
    first = kernel_choice.plan_for(tiny_step())
    assert not first.from_cache and first.cache_file is not None
    assert first.cache_file.parent == plan_cache / "kernel_plans"
    assert all(first.times_ms[b] for b, c in enumerate(all_candidates()) if len(c) > 1)

    again = kernel_choice.plan_for(tiny_step(seed=1))  # other weights, the same shapes
    assert again.from_cache and again.plan == first.plan
    assert again.times_ms == first.times_ms
    assert "| 1 | 1 |" in again.table()

    other_shape = kernel_choice.plan_for(tiny_step(hidden=32))
    assert not other_shape.from_cache and other_shape.cache_file != first.cache_file
    remeasured = kernel_choice.plan_for(tiny_step(), remeasure=True)
    assert not remeasured.from_cache and remeasured.cache_file == first.cache_file


@needs_a_choice
def test_a_set_plan_is_not_measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PLUGSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, ",".join(["aten"] * len(ROW_BUCKETS)))
    measurement = kernel_choice.plan_for(tiny_step())
    assert measurement.plan == KernelPlan.single(KERNELS_BY_NAME["aten"])
    assert measurement.cache_file is None and not any(measurement.times_ms)
    assert not (tmp_path / "kernel_plans").exists()


@needs_a_choice
@pytest.mark.parametrize("rows", [1, 5, 30, 100])
def test_each_call_runs_its_buckets_kernel_bit_for_bit(rows: int) -> None:
    """A linear under a mixed plan gives, for each row count, exactly what the kernel its
    bucket names gives."""
    libraries = kernel_setting.allowed_libraries()
    if len(libraries) < 2:
        pytest.skip("one kernel library here: nothing to dispatch between")
    # Libraries alternate from bucket to bucket: their sums round differently, so a call
    # sent to the wrong bucket's kernel shows (own variants alone agree at most rows).
    first, second = (KERNELS_BY_NAME[library] for library in libraries[:2])
    plan = KernelPlan(tuple(first if i % 2 else second for i in range(len(ROW_BUCKETS))))
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 1536, generator=generator) * 0.05).to(torch.bfloat16)
    bias = torch.randn(96, generator=generator).to(torch.bfloat16)
    linear = packed_linear.PackedLinear(weight, bias, plan=plan)
    reference = packed_linear.PackedLinear(weight, bias, kernels=[first, second])
    x = torch.randn(rows, 1536, generator=generator).to(torch.bfloat16)
    chosen = plan.for_rows(rows)
    other = second if chosen == first else first
    fp32 = torch.float32  # cpu_gemm's sums unrounded: the libraries cannot agree by chance
    assert torch.equal(linear(x, fp32), reference.run(chosen, x, fp32))
    assert not torch.equal(reference.run(other, x, fp32), reference.run(chosen, x, fp32))
    assert torch.equal(linear(x), reference.run(chosen, x))


@needs_a_choice
def test_bench_kernels_times_the_model_and_keeps_the_plan_an_engine_then_reads(
    tmp_path: Path,
) -> None:
    """`plugserve bench kernels` measures the model's matmuls now (not from the cache) and
    prints the table; an engine started after it on that model reads that plan from the
    cache. The model: a tiny random Llama of the embedded vocabulary, quick to time."""
    from plugserve.worker.random_model import write_random_model

    model = str(write_random_model(tmp_path / "tiny-llama", "tiny", device="cpu"))
    env = {**os.environ, "PLUGSERVE_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop(kernel_setting.KERNEL_ENV, None)
    # The compiled kernels from the usual cache, so that nothing is built again here.
    for name in ("kernels", "models"):
        source = cache_root() / name
        if source.exists():
            (tmp_path / name).symlink_to(source)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "plugserve.cli",
            "bench",
            "kernels",
            "--model",
            model,
            "--num-threads",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| rows | measured at | chosen |" in out and "| 257+ | from 1024 |" in out, out
    assert "plan: 1 rows: " in out and "kept in " in out, out
    plans = list((tmp_path / "kernel_plans").glob("*.json"))
    assert len(plans) == 1
    cached = json.loads(plans[0].read_text())
    assert out.split("plan: ", 1)[1].startswith(f"1 rows: {cached['plan'][0]}, ")

    engine = subprocess.run(
        [
            sys.executable,
            "-c",
            "import logging; logging.basicConfig(level=logging.INFO)\n"
            "import sys\nfrom plugserve import LLM\n"
            "LLM(model=sys.argv[1], dtype='bfloat16', kv_cache_memory='32MiB', num_threads=2)",
            model,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert engine.returncode == 0, engine.stderr[-3000:]
    assert f"measured before, cached in {plans[0]}" in engine.stderr, engine.stderr[-3000:]


@pytest.mark.skipif(not cpu_features.amx_available(), reason="no AMX tiles here")
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 100])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (40, 576), (600, 1536)])
def test_amx_tiles_compute_the_matmul_over_the_vector_kernels_weights(
    rows: int, out_features: int, in_features: int
) -> None:
    """cpu_gemm's AMX kernel reads the very k-pair-packed weights of the vector kernel:
    its fp32 sums equal an fp32 matmul of the bf16 inputs to fp32 rounding, for row counts
    that fill its 16-row tiles or not and column counts that fill its blocks or not."""
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    linear = packed_linear.PackedLinear(weight, bias, plan=KernelPlan.single(OWN_AMX))
    expected = x.float() @ weight.float().T + bias
    torch.testing.assert_close(linear(x, torch.float32), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(linear(x).float(), expected, atol=1e-2, rtol=1e-2)  # bf16 out


def fake_proc(folder: Path, busy_ticks: tuple[int, ...], processes: dict[int, tuple]) -> Path:
    """A /proc with the machine's line of stat (user nice system idle iowait irq softirq
    steal) and, per pid, a stat line with its process group and (utime, stime)."""
    user, nice, system, irq, softirq, steal = busy_ticks
    (folder / "stat").write_text(
        f"cpu  {user} {nice} {system} 99999 7 {irq} {softirq} {steal} 0 0\ncpu0 1 2 3\n"
    )
    for pid, (group, utime, stime) in processes.items():
        (folder / str(pid)).mkdir()
        # comm with a space and a parenthesis: the fields are read after the last ")".
        fields = ["S", "1", str(group), *["0"] * 8, str(utime), str(stime), "0", "0"]
        (folder / str(pid) / "stat").write_text(f"{pid} (a (b) c) {' '.join(fields)}\n")
    return folder


def test_cpu_usage_counts_the_machine_and_this_process_group_from_proc(tmp_path: Path) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    group = os.getpgrp()
    proc = fake_proc(
        tmp_path,
        (100, 20, 50, 3, 2, 25),
        {10: (group, 30, 12), 11: (group + 1, 500, 500), 12: (group, 1, 1)},
    )
    usage = cpu_usage.cpu_usage(proc)
    assert usage is not None
    assert usage.machine_busy == pytest.approx(200 / tick)  # steal counts, idle and iowait not
    assert usage.own_group == pytest.approx(44 / tick)
    assert cpu_usage.cpu_usage(tmp_path / "none") is None  # no /proc: unknown


def test_this_process_work_counts_in_its_own_group_on_the_real_proc() -> None:
    before = cpu_usage.cpu_usage()
    if before is None:
        pytest.skip("no /proc/stat here")
    deadline = time.monotonic() + 60  # liveness only
    while (now := cpu_usage.cpu_usage()).own_group == before.own_group:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "this process's CPU time never showed"
        sum(range(100_000))
    assert now.machine_busy >= before.machine_busy


def test_others_share_is_the_busy_time_outside_this_process_group() -> None:
    cores = os.cpu_count() or 1
    before = cpu_usage.CpuUsage(wall=10.0, machine_busy=100.0, own_group=40.0)
    # Two seconds: this group took 1 core-second, others 0.5 x the whole machine.
    after = cpu_usage.CpuUsage(wall=12.0, machine_busy=100.0 + 1 + cores, own_group=41.0)
    assert cpu_usage.others_share(before, after) == pytest.approx(0.5)
    only_own = cpu_usage.CpuUsage(wall=12.0, machine_busy=101.0, own_group=41.0)
    assert cpu_usage.others_share(before, only_own) == 0.0
    assert cpu_usage.others_share(before, before) is None  # no time passed
    assert cpu_usage.others_share(None, after) is None


@needs_a_choice
def test_a_plan_timed_beside_a_busy_process_is_used_but_not_kept(
    monkeypatch: pytest.MonkeyPatch, plan_cache: Path
) -> None:
    """The share of other processes is read from /proc before and after the timing (here
    readings that say a neighbour took most of the machine, then that it left)."""
    cores = os.cpu_count() or 1
    readings = iter(
        [
            cpu_usage.CpuUsage(wall=0.0, machine_busy=0.0, own_group=0.0),
            cpu_usage.CpuUsage(wall=1.0, machine_busy=0.9 * cores, own_group=0.0),
            cpu_usage.CpuUsage(wall=2.0, machine_busy=0.9 * cores, own_group=0.0),
            cpu_usage.CpuUsage(wall=3.0, machine_busy=0.9 * cores + 1, own_group=1.0),
        ]
    )
    monkeypatch.setattr(kernel_choice, "cpu_usage", lambda: next(readings))
    contended = kernel_choice.plan_for(tiny_step())
    assert contended.contended and contended.others_share == pytest.approx(0.9)
    assert contended.cache_file is None and not (plan_cache / "kernel_plans").exists()
    assert all(
        len(bucket) == 1 or contended.times_ms[b] for b, bucket in enumerate(all_candidates())
    )

    again = kernel_choice.plan_for(tiny_step())  # nothing was kept: measured again
    assert not again.from_cache and not again.contended
    assert again.others_share == 0.0 and again.cache_file is not None


@needs_a_choice
def test_a_plan_timed_on_request_beside_a_busy_process_is_kept_and_says_so(
    monkeypatch: pytest.MonkeyPatch, plan_cache: Path
) -> None:
    """`plugserve bench kernels` (remeasure) keeps what it timed even on a busy machine:
    the user asked for that plan; what it prints says the machine was busy."""
    cores = os.cpu_count() or 1
    readings = iter(
        [
            cpu_usage.CpuUsage(wall=0.0, machine_busy=0.0, own_group=0.0),
            cpu_usage.CpuUsage(wall=1.0, machine_busy=0.9 * cores, own_group=0.0),
        ]
    )
    monkeypatch.setattr(kernel_choice, "cpu_usage", lambda: next(readings))
    kept = kernel_choice.plan_for(tiny_step(), remeasure=True)
    assert kept.contended and kept.cache_file is not None and kept.cache_file.exists()
    assert f"kept in {kept.cache_file}" in kept.describe()
    assert "other processes took 90% of the CPUs" in kept.describe()
    assert kernel_choice.plan_for(tiny_step()).from_cache
