"""What engine.device and engine.dtype mean on this machine (plugserve.device)."""

from __future__ import annotations

import pytest
import torch

from plugserve import ops
from plugserve.device import choose_dtype, resolve_device, resolve_dtype
from plugserve.ops import build


def test_auto_device_is_cuda_only_where_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_dtype_is_bf16_on_a_gpu_and_on_a_cpu_with_native_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    assert choose_dtype("auto", torch.device("cuda")) == (torch.bfloat16, "auto: CUDA")
    cpus = {
        "fpu avx2 avx512f avx512_bf16": (torch.bfloat16, "auto: the CPU has avx512_bf16"),
        "fpu avx512f amx_tile amx_bf16": (torch.bfloat16, "auto: the CPU has amx_bf16"),
        "fpu avx512f avx512_bf16 amx_bf16": (
            torch.bfloat16,
            "auto: the CPU has avx512_bf16 and amx_bf16",
        ),
        "fpu avx2 avx512f": (
            torch.float32,
            "auto: the CPU has neither avx512_bf16 nor amx_bf16",
        ),
    }
    for flags, expected in cpus.items():
        monkeypatch.setattr(ops, "cpu_flags", lambda flags=flags: flags)
        assert choose_dtype("auto", cpu) == expected, flags
        assert resolve_dtype("auto", cpu) == expected[0]
    for name, dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16)]:
        assert choose_dtype(name, cpu) == (dtype, "engine.dtype")
        assert resolve_dtype(name, torch.device("cuda")) == dtype
    assert resolve_dtype("float16", cpu) == torch.float16


def test_hidden_cpu_flags_are_left_out_of_every_decision(monkeypatch: pytest.MonkeyPatch):
    """PLUGSERVE_HIDE_CPU_FLAGS: every process acts as on a CPU without those flags (how
    a test serves as on another CPU); compiled libraries stay keyed by the real ones."""
    monkeypatch.setattr(build, "_machine_cpu_flags", lambda: "flags : fpu avx512f avx512_bf16")
    build.cpu_flags.cache_clear()
    monkeypatch.setenv(build.HIDE_CPU_FLAGS_ENV, "avx512_bf16,amx_bf16")
    try:
        assert build.cpu_flags().split() == ["flags", ":", "fpu", "avx512f"]
        monkeypatch.setattr(ops, "cpu_flags", build.cpu_flags)
        assert choose_dtype("auto", torch.device("cpu"))[0] == torch.float32
    finally:
        build.cpu_flags.cache_clear()
