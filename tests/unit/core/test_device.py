"""What engine.device and engine.dtype mean on this machine (plugserve.device)."""

from __future__ import annotations

import pytest
import torch

from plugserve.device import resolve_device, resolve_dtype


def test_auto_device_is_cuda_only_where_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_dtype_is_bf16_on_a_gpu_and_fp32_on_a_cpu() -> None:
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    for name, dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16)]:
        assert resolve_dtype(name, torch.device("cpu")) == dtype
        assert resolve_dtype(name, torch.device("cuda")) == dtype
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
