"""Device and dtype policy: which device and dtype `engine.device` / `engine.dtype` mean on
this machine. Every process that places a model (the engine core, a tensor-parallel
worker) or reasons about where the forward pass runs (the engine's busy loop) asks here,
without importing the model runner."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# CPU flags of native bf16 arithmetic: AVX512-BF16's dot products and AMX's bf16 tiles.
# Where the CPU has either, the bf16 kernels (the cpu_bf16 linear method) read half the
# bytes of fp32 at the same arithmetic speed or better; without them bf16 is converted in
# software, slower than fp32.
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_device(name: str) -> torch.device:
    """The device `name` means here: auto is CUDA where available, else the CPU; cuda
    without a CUDA device is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("engine.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype `name` means on `device` (choose_dtype)."""
    return choose_dtype(name, device)[0]


def choose_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype `name` means on `device`, and why, for the start-up log. auto is bf16 on
    a GPU and on a CPU with native bf16 (NATIVE_BF16_CPU_FLAGS), fp32 on other CPUs."""
    if name != "auto":
        return DTYPES[name], "engine.dtype"
    if device.type == "cuda":
        return torch.bfloat16, "auto: CUDA"
    if device.type != "cpu":
        return torch.float32, f"auto: {device.type}"
    from plugserve import ops

    flags = ops.cpu_flags().split()
    native = [flag for flag in NATIVE_BF16_CPU_FLAGS if flag in flags]
    if native:
        return torch.bfloat16, f"auto: the CPU has {' and '.join(native)}"
    return torch.float32, f"auto: the CPU has neither {' nor '.join(NATIVE_BF16_CPU_FLAGS)}"


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")
