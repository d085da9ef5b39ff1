"""The compiled CPU ops: plugserve's own C++ kernels, the public headers a kernel plugin
builds against, the helper that compiles both once per machine, and huge-page memory.

A kernel plugin depends on this package, never on the worker's internals. Its Python side
needs only:

- `load(source)` / `unavailable_reason(source)`: compile a .cpp file that registers torch
  operators or classes (TORCH_LIBRARY) with the system C++ compiler (-march=native,
  OpenMP, torch's headers), cache the library per machine, load it into torch.ops; False
  (or the reason) where that fails, so the caller keeps a pure-torch path.
- `cpu_flags()`: the CPU's feature flags, for a plugin that dispatches on them.
- `include_dir()`: the folder of the public headers; `load` puts it on the include path.
- `huge_page_buffer(num_bytes)`, `HUGE_PAGE_BYTES`: a 2 MB-aligned uint8 CPU tensor that
  Linux may back with huge pages, for what a kernel streams every step (a KV cache).

The public C++ ABI is the headers in `include_dir()`, included with quotes
(`#include "cpu_bf16.h"`); everything they declare is in `namespace plugserve`:

- cpu_bf16.h: `to_float` and `store`, bf16 <-> fp32 conversions written so that loops
  over them vectorize.
- cpu_vec_math.h (AVX-512F): `load16`/`store16` (16 bf16 or fp32 elements as fp32 lanes,
  stored rounded as `store` does), `exp16` and `silu_mul16`.
- layer_attention.h: `LayerAttentionFn`, one layer's attention as a plain C++ call; an
  attention backend that offers one (AttentionBackend.cpu_layer_call) hands its address
  and context to the fused CPU decoder, which calls it for every layer.
- row_pool.h (Linux, x86-64): `RowPool`, the batch-1 work split over the caller and one
  helper thread that the one-row matmuls use, and `lookup_row_pool()`, which finds the
  process's pool (owned by cpu_gemm.cpp's library) through torch's dispatcher, so that a
  plugin's kernel shares the same helper without linking to core's libraries.

A source's build is keyed by its own text and the text of the headers it includes,
transitively, so editing a header rebuilds only the libraries that include it. The other
headers here (cpu_gemm.h, cpu_ops.h) belong to core's libraries below and may change in
any release.

`plugserve.ops.process_env` says what environment an engine process starts with for
these kernels (GOMP_SPINCOUNT); whoever spawns engines asks it, and this package imports
torch only once one of the names above is used.

Core's own libraries, whose Python wrappers live in the worker (cpu_linear, cpu_ops):
cpu_gemm.cpp (packed bf16 matmuls and the row pool), cpu_ops.cpp (fused norm, RoPE,
SiLU * up, argmax) and cpu_decoder.cpp (a stretch of the layer stack as one op).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugserve.ops.build import cpu_flags, include_dir, load, unavailable_reason
    from plugserve.ops.memory import HUGE_PAGE_BYTES, huge_page_buffer

# build and memory import torch, which the process that spawns engines does not need for
# the one thing it takes from here (process_env): their names load on first use.
_LAZY_NAMES = {
    "cpu_flags": "build",
    "include_dir": "build",
    "load": "build",
    "unavailable_reason": "build",
    "HUGE_PAGE_BYTES": "memory",
    "huge_page_buffer": "memory",
}
_SUBMODULES = ("build", "memory", "process_env")

_HERE = Path(__file__).parent
GEMM_SOURCE = _HERE / "cpu_gemm.cpp"
OPS_SOURCE = _HERE / "cpu_ops.cpp"
DECODER_SOURCE = _HERE / "cpu_decoder.cpp"

__all__ = [
    "DECODER_SOURCE",
    "GEMM_SOURCE",
    "HUGE_PAGE_BYTES",
    "OPS_SOURCE",
    "cpu_flags",
    "huge_page_buffer",
    "include_dir",
    "load",
    "unavailable_reason",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
