"""PackedLinear (bf16 on CPU) against an fp32 matmul of the same bf16 operands.

Each kernel wherever this machine can run it (cpu_gemm.cpp on AVX512_BF16 CPUs, also where
production prefers oneDNN, as on AMX CPUs; oneDNN wherever it has bf16 matmuls): the
result is the fp32 product rounded once to bf16, up to fp32 summation order.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from plugserve import ops
from plugserve_plugins.cpu_bf16 import (
    cpu_features,
    exponent_coding,
    kernel_setting,
    packed_linear,
    weight_arena,
)
from tests.kernel_support import missing_cpu_flags

# cpu_gemm.cpp forced (conftest.py's own_kernel), skipped where this CPU cannot run it.
on_own_kernel = pytest.mark.usefixtures("own_kernel")


@pytest.fixture(params=["own", "fma", "onednn"])
def kernel(request: pytest.FixtureRequest) -> str:
    """Each kernel in turn, wherever it runs: either is production's choice on some CPU."""
    request.getfixturevalue(f"{request.param}_kernel")
    return request.param


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()


def assert_rounded_once(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    # One bf16 rounding (2^-8 relative), plus fp32 summation-order noise around zero.
    torch.testing.assert_close(actual.float(), expected, rtol=2**-8, atol=1e-3)


# Rows cover one to several 8-row tiles with remainders (one row has a loop of its own;
# the FMA kernel's 6- or 12-row tiles, and its one- and two-row ones, are covered too);
# 100, 40 and 24 output columns end in a partial 16-column block (and in a partial vector
# of a 32-column panel); 70 inputs are 35 k-pairs, not a multiple of the one-row loop's
# four; 49152 x 576 is SmolLM2's LM head.
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 26, 70])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (100, 64), (40, 1536), (24, 70)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_is_the_fp32_product_rounded_once(
    rows: int, out_features: int, in_features: int, with_bias: bool, kernel: str
) -> None:
    torch.manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.05
    bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)

    linear = packed_linear.PackedLinear(weight, bias)
    out = linear(x)

    assert linear.own_kernel == (kernel == "own")
    assert (linear.fma_weight is not None) == (kernel == "fma")
    assert_rounded_once(out, reference(x, weight, bias))
    if kernel == "fma":  # its fp32 output is the same sums, unrounded
        unrounded = linear(x, torch.float32)
        torch.testing.assert_close(unrounded, reference(x, weight, bias), rtol=1e-5, atol=1e-4)
        assert torch.equal(unrounded.bfloat16(), out)


def test_lm_head_sized_matmul(kernel: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(49152, 576, dtype=torch.bfloat16) * 0.05
    x = torch.randn(4, 576, dtype=torch.bfloat16)
    linear = packed_linear.PackedLinear(weight)
    assert linear.own_kernel == (kernel == "own")
    assert_rounded_once(linear(x), reference(x, weight, None))


@on_own_kernel
@pytest.mark.parametrize("rows", [1, 13])
def test_a_matmul_is_exact_while_another_thread_takes_a_core(rows: int) -> None:
    """Each kernel thread works its own share of the columns, then takes what is left of
    the others': with a busy thread beside them (as the API server is, once a token), every
    column is still computed exactly once, whichever thread computes it."""
    torch.manual_seed(rows)
    weight = torch.randn(3072, 576, dtype=torch.bfloat16) * 0.05
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
    try:
        linear = packed_linear.PackedLinear(weight)
        expected = linear(x)
        assert_rounded_once(expected, reference(x, weight, None))
        busy.start()
        for _ in range(100):
            assert torch.equal(linear(x), expected)
    finally:
        stop.set()
        if busy.is_alive():
            busy.join()
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    ("setting", "uses_helper"),
    [(None, False), ("300000", False), ("2000", True), ("INFINITY", False)],
)
def test_the_row_pool_is_for_processes_whose_openmp_spins_briefly(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, uses_helper: bool
) -> None:
    if setting is None:
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    else:
        monkeypatch.setenv("GOMP_SPINCOUNT", setting)
    assert cpu_features.openmp_spins_briefly() is uses_helper


@on_own_kernel
@pytest.mark.parametrize(("setting", "uses_helper"), [(None, False), ("2000", True)])
def test_loading_the_kernel_turns_the_row_pool_on_only_where_openmp_spins_briefly(
    setting: str | None, uses_helper: bool
) -> None:
    """In a fresh process (OpenMP reads GOMP_SPINCOUNT once, when it loads), as an engine
    process (2000) and as an offline one (unset)."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if setting is not None:
        env["GOMP_SPINCOUNT"] = setting
    code = (
        "import torch\n"
        "from plugserve_plugins.cpu_bf16 import cpu_features\n"
        "assert cpu_features.own_kernel_unavailable_reason() is None\n"
        "print(torch.ops.plugserve_ops.row_pool_enabled())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(uses_helper)


# The longest a helper held on a block waits for row_pool_release_helper: a liveness bound,
# reached only by a caller that waits for its helper instead of taking the block over.
HELPER_HOLD_US = 1_000_000


@on_own_kernel
@pytest.mark.usefixtures("row_pool")
def test_a_block_its_helper_is_slow_to_finish_is_taken_over_and_its_late_result_dropped() -> None:
    """The one-row path shares its blocks with a helper thread (row_pool.h) that the
    caller never waits for: when the helper is displaced in the middle of a block (here:
    held on it until released), the caller computes that block itself and returns; the
    helper's result, ready after its release, is dropped, not written into what the caller
    has since done with its output."""
    torch.manual_seed(7)
    weight = torch.randn(1000, 576, dtype=torch.bfloat16) * 0.05  # 63 blocks, the last of 8
    bias = torch.randn(1000, dtype=torch.bfloat16)
    inputs = [torch.randn(1, 576, dtype=torch.bfloat16) for _ in range(4)]
    pool = torch.ops.plugserve_ops  # the row pool is core's cpu_ops.cpp's
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        linear = packed_linear.PackedLinear(weight, bias)
        expected = [linear(x) for x in inputs]
        for x, out in zip(inputs, expected, strict=True):
            assert_rounded_once(out, reference(x, weight, bias))
        # Tries until the helper has taken a block: an idle-class thread on a busy machine may
        # need hundreds (the deadline is for liveness only).
        deadline = time.monotonic() + 30
        while True:
            linear(inputs[1])  # the helper is awake (it sleeps after 50 us idle)
            taken = pool.row_pool_items_taken_over()
            dropped = pool.row_pool_late_items_dropped()
            pool.row_pool_stall_helper_once(HELPER_HOLD_US)
            first = linear(inputs[0])
            if pool.row_pool_items_taken_over() > taken:
                break
            pool.row_pool_release_helper()  # it took no block of this call: again
            assert time.monotonic() < deadline, "the helper took no block, or the caller waited"
        # The caller took over the block the helper held, and computed it itself.
        assert pool.row_pool_items_taken_over() == taken + 1
        assert torch.equal(first, expected[0])
        # The result is the caller's now: a late write from the helper would show here.
        first.zero_()
        later = [linear(x) for x in inputs[1:] for _ in range(20)]  # the helper still held
        pool.row_pool_release_helper()
        later += [linear(x) for x in inputs[1:] for _ in range(20)]  # and back meanwhile
        deadline = time.monotonic() + 30  # liveness only: it is back within microseconds
        while pool.row_pool_late_items_dropped() == dropped:
            assert time.monotonic() < deadline, "the released helper kept the block it had lost"
            time.sleep(0.001)
        assert torch.count_nonzero(first) == 0
        assert all(torch.equal(out, expected[1 + i // 20 % 3]) for i, out in enumerate(later))
    finally:
        pool.row_pool_release_helper()
        torch.set_num_threads(previous)


@on_own_kernel
@pytest.mark.usefixtures("row_pool")
def test_a_late_helper_reads_a_weight_the_caller_has_freed_safely() -> None:
    """The helper held on a block still reads that job's weight when it is released;
    the caller has taken the block over, returned, and freed the weight (3.5 MB: its
    memory goes back to the system). The job's own reference keeps it mapped until the
    helper is done."""
    torch.manual_seed(9)
    x = torch.randn(1, 576, dtype=torch.bfloat16)
    pool = torch.ops.plugserve_ops  # the row pool is core's cpu_ops.cpp's
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(5):
            weight = torch.randn(3072, 576, dtype=torch.bfloat16) * 0.05
            linear = packed_linear.PackedLinear(weight)
            expected = reference(x, weight, None)
            # Until the helper takes an item of a call (an idle-class thread on a busy
            # machine may sleep through many) and is held on it until released: the caller
            # then takes that item over (the deadline is for liveness only).
            deadline = time.monotonic() + 30
            while True:
                linear(x)  # the helper is awake (it sleeps after a short idle spell)
                taken = pool.row_pool_items_taken_over()
                dropped = pool.row_pool_late_items_dropped()
                pool.row_pool_stall_helper_once(HELPER_HOLD_US)
                out = linear(x)
                if pool.row_pool_items_taken_over() > taken:
                    break
                pool.row_pool_release_helper()  # it took no item of this call: again
                assert time.monotonic() < deadline, "the helper never took an item"
            del linear, weight
            pool.row_pool_release_helper()
            # It wakes, computes from the freed weight and drops what it finds taken over.
            while pool.row_pool_late_items_dropped() == dropped:
                assert time.monotonic() < deadline, "the held helper never came back"
                time.sleep(0.001)
            assert_rounded_once(out, expected)
    finally:
        pool.row_pool_release_helper()
        torch.set_num_threads(previous)


@on_own_kernel
@pytest.mark.usefixtures("row_pool")
def test_one_row_matmuls_from_two_threads_at_once_are_each_exact() -> None:
    """One caller at a time shares the helper; a second one meanwhile runs alone."""
    torch.manual_seed(8)
    weight = torch.randn(3072, 576, dtype=torch.bfloat16) * 0.05
    linear = packed_linear.PackedLinear(weight)
    inputs = [torch.randn(1, 576, dtype=torch.bfloat16) for _ in range(2)]
    expected = [linear(x) for x in inputs]
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    mismatches: list[int] = []

    def call_repeatedly(i: int) -> None:
        for _ in range(200):
            if not torch.equal(linear(inputs[i]), expected[i]):
                mismatches.append(i)

    threads = [threading.Thread(target=call_repeatedly, args=(i,)) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        torch.set_num_threads(previous)
    assert mismatches == []


@pytest.mark.usefixtures("kernel")
def test_rows_with_a_stride_are_read_in_place() -> None:
    """A column slice of a wider tensor (its rows not adjacent) gives the same result."""
    torch.manual_seed(1)
    weight = torch.randn(64, 32, dtype=torch.bfloat16)
    wide = torch.randn(5, 48, dtype=torch.bfloat16)
    x = wide[:, :32]
    assert_rounded_once(packed_linear.PackedLinear(weight)(x), reference(x, weight, None))


def test_k_pair_layout_puts_sixteen_columns_of_a_k_pair_together() -> None:
    weight = torch.arange(20 * 4, dtype=torch.float32).view(20, 4).to(torch.bfloat16)
    packed = weight_arena.pack_k_pairs(weight)
    assert packed.shape == (2, 2, 16, 2)  # 20 columns → 2 blocks (the second padded)
    # Block 0, k-pair 1, column 3 holds W[3, 2:4].
    assert packed[0, 1, 3].tolist() == weight[3, 2:4].tolist()
    # Block 1, column 2 is output 18; columns past 20 are zero padding.
    assert packed[1, 0, 2].tolist() == weight[18, 0:2].tolist()
    assert packed[1, :, 4:].abs().sum() == 0


@on_own_kernel
@pytest.mark.usefixtures("row_pool")
@pytest.mark.parametrize("rows", [1, 3, 13])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_output_is_the_fp32_product_unrounded(rows: int, with_bias: bool) -> None:
    """out_dtype=float32 (the LM head's logits) keeps the kernel's fp32 sums: its bf16
    rounding is exactly the bf16 output. At one row the row pool's helper, once awake,
    computes blocks too and commits them at fp32 width; two inputs alternate so that a
    block left unwritten would show the other one's result."""
    torch.manual_seed(rows)
    weight = torch.randn(1000, 576, dtype=torch.bfloat16) * 0.05
    bias = torch.randn(1000, dtype=torch.bfloat16) if with_bias else None
    inputs = [torch.randn(rows, 576, dtype=torch.bfloat16) for _ in range(2)]
    linear = packed_linear.PackedLinear(weight, bias)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = [linear(x, torch.float32) for x in inputs]
        rounded = [linear(x) for x in inputs]
        repeated = [(i % 2, linear(inputs[i % 2], torch.float32)) for i in range(400)]
    finally:
        torch.set_num_threads(previous)

    for x, out, bf16 in zip(inputs, expected, rounded, strict=True):
        assert out.dtype == torch.float32 and out.shape == (rows, 1000)
        torch.testing.assert_close(out, reference(x, weight, bias), rtol=1e-5, atol=1e-4)
        assert torch.equal(out.bfloat16(), bf16)
    assert all(torch.equal(out, expected[i]) for i, out in repeated)


@on_own_kernel
def test_own_kernel_rejects_mismatched_inputs() -> None:
    packed = weight_arena.pack_k_pairs(torch.zeros(32, 16, dtype=torch.bfloat16))
    op = torch.ops.plugserve_gemm.linear_bf16
    with pytest.raises(RuntimeError, match="x has 18 features"):
        op(torch.zeros(2, 18, dtype=torch.bfloat16), packed, 32, None)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        op(torch.zeros(2, 16, dtype=torch.bfloat16), packed, 8, None)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        op(torch.zeros(2, 16), packed, 32, None)
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16 or float32"):
        op(torch.zeros(2, 16, dtype=torch.bfloat16), packed, 32, None, torch.float16)


def test_odd_input_width_runs_on_a_kernel_that_takes_it(kernel: str) -> None:
    """cpu_gemm.cpp needs whole k-pairs: an odd width falls back to oneDNN (or ATen), whose
    fp32 is its bf16 result widened; the FMA tiles' panels take any width and keep their sums."""
    torch.manual_seed(2)
    weight = torch.randn(48, 33, dtype=torch.bfloat16)
    x = torch.randn(3, 33, dtype=torch.bfloat16)
    linear = packed_linear.PackedLinear(weight)
    assert not linear.own_kernel
    assert_rounded_once(linear(x), reference(x, weight, None))
    as_fp32 = linear(x, torch.float32)  # asked for fp32, as the LM head asks
    assert as_fp32.dtype == torch.float32
    if kernel == "fma":
        assert linear.fma_weight is not None and torch.equal(as_fp32.bfloat16(), linear(x))
    else:
        assert torch.equal(as_fp32, linear(x).float())


@on_own_kernel
def test_an_arena_holds_packed_weights_back_to_back_from_a_huge_page_boundary() -> None:
    torch.manual_seed(3)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) for n, k in [(40, 64), (960, 576)]]
    arena = weight_arena.WeightArena.for_weights([*weights, torch.zeros(8, 33)])  # 2 fit
    assert arena is not None
    linears = [packed_linear.PackedLinear(w, arena=arena) for w in weights]

    first, second = (linear.weight for linear in linears)
    assert first.data_ptr() % ops.HUGE_PAGE_BYTES == 0
    assert second.data_ptr() == first.data_ptr() + 2 * first.numel()
    for linear, weight in zip(linears, weights, strict=True):
        assert torch.equal(linear.weight, weight_arena.pack_k_pairs(weight))
        x = torch.randn(3, weight.shape[1], dtype=torch.bfloat16)
        assert_rounded_once(linear(x), reference(x, weight, None))
    with pytest.raises(ValueError, match="arena full"):
        packed_linear.PackedLinear(weights[0], arena=arena)


def test_huge_page_buffer_is_aligned_writable_and_eligible_for_huge_pages() -> None:
    buffer = ops.huge_page_buffer(3 * ops.HUGE_PAGE_BYTES + 5)
    assert buffer.numel() == 3 * ops.HUGE_PAGE_BYTES + 5
    assert buffer.data_ptr() % ops.HUGE_PAGE_BYTES == 0
    buffer.fill_(7)
    assert int(buffer[-1]) == 7 and int(buffer.sum()) == 7 * buffer.numel()
    if thp_mode() in ("always", "madvise"):  # the kernel may then back it with 2 MB pages
        assert vma_field(buffer.data_ptr(), "THPeligible") == "1"


def thp_mode() -> str | None:
    try:
        modes = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return modes.split("[")[1].split("]")[0]


def vma_field(address: int, field: str) -> str:
    """A field of /proc/self/smaps for the mapping holding `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == f"{field}:":
            return line.split()[1]
    raise AssertionError(f"no {field} for address {address:#x}")


# ------------------------------------------- which kernel: the machine's, production's


def fake_cpu_flags(monkeypatch: pytest.MonkeyPatch, add: list[str], drop: list[str]) -> None:
    """ops.cpu_flags() as on a CPU with `add` and without `drop` (the library
    loaded first, under this CPU's flags, so as not to build it again under the fake ones)."""
    cpu_features.own_kernel_unavailable_reason()
    flags = [flag for flag in ops.cpu_flags().split() if flag not in drop]
    monkeypatch.setattr(ops, "cpu_flags", lambda: " ".join([*flags, *add]))


@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
def test_every_kernel_that_runs_here_is_a_candidate_unless_one_is_named(
    monkeypatch: pytest.MonkeyPatch, amx: bool
) -> None:
    """No CPU flag decides between the kernels (the measured plan does): with AMX or
    without, every library that runs is a candidate, and PLUGSERVE_CPU_BF16_KERNEL narrows
    them to one."""
    fake_cpu_flags(monkeypatch, add=["amx_bf16"] if amx else [], drop=["amx_bf16"])
    # Where the CPU has cpu_gemm.cpp's instructions it must run (a failed build fails here).
    runnable = not missing_cpu_flags(cpu_features.OWN_KERNEL_CPU_FLAGS)
    fma_tiles = not missing_cpu_flags(cpu_features.FMA_KERNEL_CPU_FLAGS)
    onednn = cpu_features.onednn_bf16_supported()
    monkeypatch.delenv(kernel_setting.KERNEL_ENV, raising=False)
    expected = (
        *(["own"] if runnable else []),
        *(["fma"] if fma_tiles else []),
        *(["onednn"] if onednn else []),
        "aten",
    )
    assert kernel_setting.allowed_libraries() == expected
    weight = torch.zeros(32, 64, dtype=torch.bfloat16)
    if onednn:
        monkeypatch.setenv(kernel_setting.KERNEL_ENV, "onednn")
        assert kernel_setting.allowed_libraries() == ("onednn",)
        assert not packed_linear.PackedLinear(weight).own_kernel
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, "fma")
    if fma_tiles:
        assert kernel_setting.allowed_libraries() == ("fma",)
        linear = packed_linear.PackedLinear(weight)
        assert linear.fma_weight is not None and not linear.own_kernel
    else:
        with pytest.raises(RuntimeError, match="cannot run here"):
            kernel_setting.allowed_libraries()
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, "own")
    if runnable:
        assert kernel_setting.allowed_libraries() == ("own",)
        assert packed_linear.PackedLinear(weight).own_kernel
    else:
        with pytest.raises(RuntimeError, match="cannot run here"):
            kernel_setting.allowed_libraries()


@pytest.mark.parametrize(
    ("drop", "reason"),
    [
        (["avx512_bf16"], "the CPU lacks avx512_bf16"),
        (["avx512f", "avx512_bf16"], "the CPU lacks avx512f and avx512_bf16"),
    ],
)
def test_a_cpu_without_avx512_bf16_is_named_as_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, drop: list[str], reason: str
) -> None:
    # The kernel's other flags present, whatever this CPU has: only `drop` is missing.
    present = [flag for flag in cpu_features.OWN_KERNEL_CPU_FLAGS if flag not in drop]
    fake_cpu_flags(monkeypatch, add=present, drop=drop)
    assert cpu_features.own_kernel_unavailable_reason() == reason
    monkeypatch.delenv(kernel_setting.KERNEL_ENV, raising=False)
    assert "own" not in kernel_setting.allowed_libraries()
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, "own")
    with pytest.raises(
        RuntimeError, match=f"KERNEL=own, but cpu_gemm.cpp cannot run here: {reason}"
    ):
        kernel_setting.allowed_libraries()
    with pytest.raises(RuntimeError, match=re.escape(reason)):
        exponent_coding.code_exponents(torch.zeros(1, 2, 16, 2, dtype=torch.bfloat16))


def test_without_a_compiler_the_reason_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    compiler = tmp_path / "no-such-c++"
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("PLUGSERVE_CACHE_DIR", str(tmp_path))  # no build of it there
    monkeypatch.setattr(ops.build, "_failures", {})  # nothing tried yet
    assert cpu_features._load_own_kernel.__wrapped__() == (
        f"cpu_gemm.cpp cannot be built or loaded: no C++ compiler: {compiler} not found (set $CXX)"
    )


def test_an_unknown_kernel_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="PLUGSERVE_CPU_BF16_KERNEL='fastest'"):
        kernel_setting.allowed_libraries()
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, "own,onednn")  # two buckets of four
    with pytest.raises(ValueError, match="expected 5 kernels"):
        kernel_setting.forced_plan()
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, "own,own,own,fastest")
    with pytest.raises(ValueError, match="expected 5 kernels"):
        kernel_setting.forced_plan()


def test_a_plan_can_be_set_one_kernel_per_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, " aten, aten ,aten,aten,aten")
    plan = kernel_setting.forced_plan()
    assert plan is not None and plan.libraries() == {"aten"}
    assert kernel_setting.allowed_libraries() == ("aten",)
    assert kernel_setting.default_plan() == plan


@on_own_kernel
@pytest.mark.usefixtures("row_pool")
def test_the_row_pool_lets_go_of_the_tensors_its_last_jobs_ran_over() -> None:
    """A one-row job's slot holds references to its weight, so that a helper coming back
    late still reads live memory; released (as after the kernel choice has timed its own
    copies of the weights), the slots hold nothing, and a weight no one else holds is
    freed."""
    x = torch.randn(1, 576, dtype=torch.bfloat16)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        linear = packed_linear.PackedLinear(torch.randn(1000, 576, dtype=torch.bfloat16))
        assert linear.weight is not None
        weight = StorageWeakRef(linear.weight.untyped_storage())
        shared = torch.ops.plugserve_ops.row_pool_jobs_shared()
        linear(x)
        assert torch.ops.plugserve_ops.row_pool_jobs_shared() > shared  # a job of the pool
        del linear
        gc.collect()
        assert not weight.expired()  # in the job's slot
        # Liveness only: the helper goes idle within microseconds of the job.
        assert torch.ops.plugserve_ops.row_pool_release_inputs(30_000_000)
        assert weight.expired()
    finally:
        torch.set_num_threads(previous)
