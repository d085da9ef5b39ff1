"""The compiled CPU ops: core's own C++ kernels (cpu_ops.cpp), the public headers a kernel
plugin builds against, the helper that compiles both once per machine, and huge-page
memory.

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
- cpu_fma_tiles.h (namespace plugserve::fma; AVX-512F's 16-float vectors, else AVX2 +
  FMA's 8): a matmul in fp32 FMA register tiles over a weight packed once into panels
  (`pack_panels`, `linear_rows`), the weight fp32 or bf16 (widened in registers), the
  output fp32 or bf16: the cpu_fp32 method's `fma` kernel and cpu_bf16's `fma` library.
- cpu_ops.h: the elementwise kernels of a decoder layer that cpu_ops.cpp registers
  (`rms_norm_impl`, `fused_add_rms_norm_impl`, `rms_norm_heads_impl`,
  `rotary_embedding_impl`, `silu_and_mul_impl`) and their argument checks, for a plugin's
  fused ops to run inside its own (the bf16 CPU fast path's cpu_decoder.cpp).
- layer_attention.h: `LayerAttentionFn`, one layer's attention as a plain C++ call; an
  attention backend that offers one (AttentionBackend.cpu_layer_call) hands its address
  and context to a fused CPU decoder, which calls it for every layer.
- layer_linear.h: `LinearCallFn`, one linear layer's matmul as a plain C++ call; a
  layer's installed matmul that offers one (capabilities.SupportsCpuLinearCall, the int8
  W8A8 method's) hands its address and context to a fused CPU decoder, which calls it in
  place of its own packed matmul.
- row_pool.h (Linux, x86-64): `RowPool`, the batch-1 work split over the caller and one
  helper thread, and `lookup_row_pool()`, which finds the process's one pool through
  torch's dispatcher, so that every plugin's kernel (the bf16 and int8 matmuls, the CPU
  attention) shares the same helper without linking to another library. The pool is
  core's: cpu_ops.cpp owns it and registers `plugserve_ops::row_pool_address` (and
  row_pool_enabled / row_pool_set_enabled), so a plugin finds it wherever cpu_ops.cpp is
  loaded (`load(OPS_SOURCE)`), whichever other plugins are. It is off until a plugin
  turns it on (the bf16 CPU kernels do, where OpenMP's threads spin briefly).

A source's build is keyed by its own text and the text of the headers it includes,
transitively, so editing a header rebuilds only the libraries that include it.

`plugserve.ops.process_env` says what environment an engine process starts with for
these kernels (GOMP_SPINCOUNT); whoever spawns engines asks it, and this package imports
torch only once one of the names above is used.

Core's own library, `OPS_SOURCE`, is cpu_ops.cpp (fused norm, q/k norm, RoPE, SiLU * up,
argmax, and the row pool), which core's layers (plugserve.worker.cpu_ops) and the sampler
call. The bf16 CPU fast path's kernels (packed matmuls, the fused decoder) are a plugin's
(plugserve_plugins.cpu_bf16), built by the same helper.
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

OPS_SOURCE = Path(__file__).parent / "cpu_ops.cpp"

__all__ = [
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
