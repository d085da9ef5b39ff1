"""Device and dtype policy: which device and dtype `engine.device` / `engine.dtype` mean on
this machine. Every process that places a model (the engine core, a tensor-parallel
worker) or reasons about where the forward pass runs (the engine's busy loop) asks here,
without importing the model runner."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The device `name` means here: auto is CUDA where available, else the CPU; cuda
    without a CUDA device is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("engine.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype `name` means on `device`: auto is bf16 on a GPU and fp32 on a CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]
