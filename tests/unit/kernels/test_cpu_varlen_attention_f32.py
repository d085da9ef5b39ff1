"""The fp32 varlen kernels (an encoder's step in fp32: cpu_varlen_attention_f32.cpp on
AVX-512F, cpu_varlen_attention_f32_avx2.cpp on AVX2) against dense float64 attention, each
build wherever the CPU has its instructions.

Whole prompts of mixed lengths side by side, each query attending to every key of its
own prompt: lengths on both sides of the kernels' 8- and 16-key groups and 64-query
chunks, GQA, soft-capping, each head size they take, rows strided as split from one
projection. The kernels compute in fp32 with an exact softmax, so they are held to 1e-5.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from plugserve_plugins.kernels import cpu_prefill_attention
from tests.kernel_support import require_kernel


@pytest.fixture(
    params=cpu_prefill_attention.FP32_VARLEN_KERNELS, ids=lambda kernel: kernel.source.name
)
def kernel(request: pytest.FixtureRequest) -> cpu_prefill_attention.Fp32VarlenKernel:
    build: cpu_prefill_attention.Fp32VarlenKernel = request.param
    require_kernel(build.source.name, build.required_cpu_flags, build.unavailable_reason())
    return build


@pytest.fixture
def chosen_kernel() -> None:
    """The build this CPU's encoders run (fp32_kernel), loaded."""
    chosen = cpu_prefill_attention.fp32_kernel()
    require_kernel(chosen.source.name, chosen.required_cpu_flags, chosen.unavailable_reason())


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None):
    """One prompt, every query seeing every key, in float64."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (
        q.double(),
        k.double().repeat_interleave(group, 1),
        v.double().repeat_interleave(group, 1),
    )
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def projected_qkv(
    total: int, heads: int, kv_heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as views of one fused projection's output: strided token rows."""
    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(total, (heads + 2 * kv_heads) * head_dim, generator=generator)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    return (
        q.view(total, heads, head_dim),
        k.view(total, kv_heads, head_dim),
        v.view(total, kv_heads, head_dim),
    )


@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "head_dim", "softcap"),
    [
        ((9, 1, 16, 17, 64, 65, 127, 130, 2), 12, 12, 32, None),  # all-MiniLM-L6-v2's heads
        ((40, 3, 100), 8, 2, 64, None),
        ((70, 17), 4, 4, 128, 30.0),
        ((5,), 2, 2, 32, 5.0),
    ],
)
def test_each_prompt_attends_to_all_of_itself(
    kernel: cpu_prefill_attention.Fp32VarlenKernel,
    lengths: tuple[int, ...],
    heads: int,
    kv_heads: int,
    head_dim: int,
    softcap: float | None,
) -> None:
    q, k, v = projected_qkv(sum(lengths), heads, kv_heads, head_dim, seed=sum(lengths))
    cu_seqlens = [0, *itertools.accumulate(lengths)]
    scale = head_dim**-0.5
    out = kernel.attend(q, k, v, cu_seqlens, scale, softcap=softcap)
    assert out.dtype == torch.float32
    for start, end in itertools.pairwise(cu_seqlens):
        expected = dense(q[start:end], k[start:end], v[start:end], scale, softcap)
        torch.testing.assert_close(out[start:end].double(), expected, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused_by_what_is_wrong(
    kernel: cpu_prefill_attention.Fp32VarlenKernel,
) -> None:
    q, k, v = projected_qkv(10, 2, 2, 32, seed=0)
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0"):
        kernel.attend(q, k, v, [0, 4, 8], 0.125)
    with pytest.raises(RuntimeError, match="cu_seqlens must not decrease"):
        kernel.attend(q, k, v, [0, 6, 4, 10], 0.125)
    q48, k48, v48 = projected_qkv(10, 2, 2, 48, seed=0)
    with pytest.raises(RuntimeError, match="head_dim 32, 64 or 128"):
        kernel.attend(q48, k48, v48, [0, 10], 0.125)


@pytest.mark.usefixtures("chosen_kernel")
def test_the_timed_choice_is_the_faster_of_the_two_timings_it_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under prefill_kernel auto an fp32 encoder takes what this returns: whichever way
    the timing goes on this machine, the answer is the one its logged timings give."""
    with caplog.at_level("INFO", logger=cpu_prefill_attention.__name__):
        faster = cpu_prefill_attention.varlen_faster_than_sdpa(12, 12, 32, torch.float32)
    [line] = [r.getMessage() for r in caplog.records if "SDPA" in r.getMessage()]
    assert "in float32" in line
    found = re.search(r"kernel ([\d.]+) ms, SDPA ([\d.]+) ms; using (the kernel|SDPA)", line)
    assert found, line
    kernel_ms, sdpa_ms, using = float(found[1]), float(found[2]), found[3]
    assert faster is (using == "the kernel")
    assert faster is (kernel_ms < sdpa_ms) or kernel_ms == sdpa_ms
