"""Paged varlen attention in plain torch ops: runs wherever torch runs (CPU, CUDA).

KV cache: one tensor [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim]; token slot s of a layer lives at flat row s of its [num_blocks * block_size,
...] view. Each step, `prepare` turns the host batch into device tensors once and
precomputes every index and mask the layers share; `forward` then writes the step's K/V
and runs scaled_dot_product_attention: one batched call for all single-token rows
(decodes) and one call per multi-token row (prefill chunks, few per step); those plans
and the call are sdpa_step.py's.

On CPU every token instead goes through a small C++ kernel (cpu_paged_attention.cpp)
that reads K/V in place from the paged cache, one query token per row: a decode row
attends to its request's context, a prefill token to the tokens up to its own.
Elsewhere, or where the kernel cannot be built, decode rows gather their context a whole
block at a time with index_select (several times faster on CPU than slot by slot with
advanced indexing) and fold each KV head's group of query heads into the query-length
dimension: one [G, L] SDPA per (row, KV head).
A step with a prefill row of SDPA_MIN_QUERY_TOKENS or more (with context before it or
not: a masked SDPA call) goes the SDPA way instead:
the C++ kernel's token-at-a-time loop is quadratic in plain vector code, SDPA's flash
kernel runs the prefill as blocked matmuls (oneDNN: AMX tiles where the CPU has them),
so the longer the prefill, the more SDPA gains (docs/benchmarks-history.md, "Figures from
code comments").
Option `kernel`: auto (the C++ kernel on CPU when it builds, SDPA for long prefills),
native, sdpa. Option `prefill_kernel` (long prefill rows, under kernel auto): auto (the
C++ prefill kernel where it runs and times faster than SDPA), on (where it runs, else an
error), off (SDPA).

Each layer attends as AttentionSpec.layers says (interfaces.model.LayerAttention): its softmax
scale, a sliding window and logit soft-capping, on every path. The C++ kernel takes them
per layer; SDPA gets the window as a mask (one per distinct window, built once a step)
and the scale as its argument, and a soft-capped layer computes its scores explicitly
(SDPA cannot cap them).

Those long prefill rows (fresh, or after gathered context) run instead a flash-style C++
kernel on avx512_bf16 (cpu_prefill_attention.cpp) where the CPU has it, the dtype is
bf16, and it timed faster than SDPA on this model's head shapes when the cache was
allocated (cpu_prefill_attention.faster_than_sdpa; both timings logged). Without AMX it
wins by a wide margin at long prompts (the same section). It applies the scale, soft-cap
and window itself.

An encoder's layers (bidirectional) run only whole prompts and never read the cache, so
nothing is written to it; each prompt attends to all of itself, through one SDPA call per
prompt or, under the same `prefill_kernel` option and its own timing
(cpu_prefill_attention.varlen_faster_than_sdpa), through one varlen call of the prefill
kernel for the whole step: in bf16 on avx512_bf16, in fp32 on avx512f or avx2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pydantic
import torch

from plugserve import hookimpl
from plugserve.hookspecs import Register
from plugserve.interfaces.model import AttentionBatch, AttentionSpec, LayerAttention
from plugserve.ops import huge_page_buffer
from plugserve_plugins.kernels import cpu_paged_attention, cpu_prefill_attention
from plugserve_plugins.kernels.sdpa_step import (
    WHOLE_PROMPTS_ONLY,
    DecodeRows,
    PrefillRow,
    Window,
    plan_decodes,
    plan_prefill,
    sdpa_attention,
    to_device,
)

# From this many query tokens in one row, a step's attention runs SDPA (see above).
SDPA_MIN_QUERY_TOKENS = 64


@dataclass(frozen=True)
class _LayerCache:
    k_blocks: torch.Tensor
    v_blocks: torch.Tensor
    k_slots: torch.Tensor
    v_slots: torch.Tensor


# An encoder's rows: whole prompts, which read no cached blocks.
_NO_BLOCKS = np.empty(0, np.int32)


@dataclass(frozen=True)
class _StepPlan:
    num_tokens: int
    # The C++ kernel's plan lives in its PagedAttentionStep; SDPA's is the fields below.
    native: bool
    # [num_tokens] where each token's k/v goes; None: nothing is written (an encoder).
    slots: torch.Tensor | None = None
    decodes: DecodeRows | None = None
    prefills: tuple[PrefillRow, ...] = ()
    # An encoder's step through the varlen kernel: where each whole prompt starts and ends.
    cu_seqlens: list[int] | None = None


class TorchPagedAttention:
    """interfaces.model.AttentionBackend with paged KV in torch tensors and SDPA
    (capabilities: SupportsCudaGraphs, SupportsFusedCpuLayer, HonoursLayerAttention,
    SupportsBatchInvariance)."""

    # capabilities.HonoursLayerAttention: every path applies the first three; bidirectional
    # layers run on the SDPA path (the C++ kernels are causal).
    layer_attention_options = frozenset(
        {"sliding_window", "logit_softcap", "scale", "bidirectional"}
    )

    class Options(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        kernel: Literal["auto", "native", "sdpa"] = "auto"
        prefill_kernel: Literal["auto", "on", "off"] = "auto"

    # Under "auto" only: long prefills through SDPA (the module docstring says why).
    _sdpa_min_query_tokens: int | None

    def __init__(self, *, spec: AttentionSpec, options: Options | None = None) -> None:
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"num_heads ({spec.num_heads}) must be a multiple of "
                f"num_kv_heads ({spec.num_kv_heads})"
            )
        self.spec = spec
        self.device = torch.device(spec.device)
        options = options or self.Options()
        choice = options.kernel
        # An encoder's layers: every prompt runs whole, unmasked (SDPA or the varlen kernel).
        self.bidirectional = any(spec.layer(i).bidirectional for i in range(spec.num_layers))
        if self.bidirectional and choice == "native":
            raise ValueError(
                "this model's layers attend bidirectionally, which the token-at-a-time "
                "kernel does not: use kernel auto or sdpa"
            )
        self.native = not self.bidirectional and self._use_native_kernel(choice)
        self._sdpa_min_query_tokens = SDPA_MIN_QUERY_TOKENS if choice == "auto" else None
        self.layers: list[LayerAttention] = [spec.layer(i) for i in range(spec.num_layers)]
        self.scales = [layer.softmax_scale(spec.head_dim) for layer in self.layers]
        # The distinct windows: the SDPA plans build one mask per window a step.
        self.windows: tuple[Window, ...] = tuple(
            sorted({layer.sliding_window for layer in self.layers}, key=lambda w: w or 0)
        )
        self.kv_cache: torch.Tensor | None = None
        self._plan: _StepPlan | None = None
        self._native_step: Any = None  # the plan in C++ (native kernel only)
        self._native_call: tuple[int, int] | None = None
        # Long prefill rows through cpu_prefill_attention (decided at allocate_kv_cache).
        self._prefill_kernel = False
        if choice != "auto" and options.prefill_kernel == "on":
            # Only kernel auto routes long prefill rows apart (native keeps them in the
            # token-at-a-time kernel, sdpa in SDPA): "on" would be dropped there.
            raise ValueError(f"prefill_kernel 'on' needs kernel 'auto' (kernel is {choice!r})")
        self._prefill_choice = options.prefill_kernel if choice == "auto" else "off"
        # A lone decode row may split its context with the row pool's helper.
        self._split_one_row = True
        self._kernel_choice = choice

    def use_batch_invariant_order(self) -> None:
        """Every token of every step through the C++ kernel, one query token per row, each
        row's context reduced front to back by one thread: prefill tokens and decodes alike,
        so that a token's attention is the same whether its prompt came in one chunk or
        several, alone or batched, or again after a preemption. Long prefill rows then
        stay in the token-at-a-time kernel (slower than SDPA's blocked one at long
        prompts; docs/configuration.md states the cost)."""
        if self.kv_cache is not None:
            raise RuntimeError("use_batch_invariant_order() must run before allocate_kv_cache()")
        if self._kernel_choice == "sdpa":
            raise ValueError(
                "engine.batch_invariant: attention option kernel 'sdpa' reduces by the "
                "row's query count; use kernel 'auto' or 'native'"
            )
        if not self.native:
            raise ValueError(
                "engine.batch_invariant: the torch attention backend keeps one order only "
                "in its C++ kernel, which runs on CPU in float32 or bfloat16 "
                f"({self.device.type}, {self.spec.dtype} here"
                + (
                    f"; {cpu_paged_attention.unavailable_reason()}"
                    if cpu_paged_attention.unavailable_reason()
                    else ""
                )
                + ")"
            )
        self._sdpa_min_query_tokens = None
        self._prefill_choice = "off"
        self._split_one_row = False

    def _use_native_kernel(self, choice: str) -> bool:
        if choice == "sdpa":
            return False
        usable = self.device.type == "cpu" and self.spec.dtype in (torch.float32, torch.bfloat16)
        if choice == "native":
            if not usable:
                raise ValueError("kernel 'native' runs on CPU in float32 or bfloat16 only")
            if not cpu_paged_attention.load():
                raise ValueError("kernel 'native' could not be built (see the log)")
            return True
        return usable and cpu_paged_attention.load()

    def kv_cache_bytes_per_block(self) -> int:
        s = self.spec
        element = torch.empty((), dtype=s.dtype).element_size()
        return 2 * s.num_layers * s.block_size * s.num_kv_heads * s.head_dim * element

    def allocate_kv_cache(self, num_blocks: int) -> None:
        s = self.spec
        # Zeros, not empty: padded keys are masked, but a NaN left in unused memory would
        # still poison the output through 0 * NaN in the value product.
        shape = (s.num_layers, 2, num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        if self.device.type == "cpu":
            # On 2 MB pages (anonymous memory, zero already, backed as it is first written):
            # a decode's blocks lie scattered over each layer's many-MB region, and on 4 KB
            # pages nearly every block read was a TLB miss, cold after the step's weights.
            element = torch.empty((), dtype=s.dtype).element_size()
            self.kv_cache = huge_page_buffer(math.prod(shape) * element).view(s.dtype).view(shape)
            # Every page written once now, not by the step that first lands on it: a long
            # prefill into untouched pages spent a large share of its step faulting them in
            # (docs/benchmarks-history.md, "Figures from code comments").
            self.kv_cache.zero_()
        else:
            self.kv_cache = torch.zeros(shape, dtype=s.dtype, device=self.device)
        # Per layer: K and V by block [num_blocks, block_size, KVH, D] and by slot
        # [num_slots, KVH, D]; built once, as a layer's forward is hot.
        self._layer_caches = [
            _LayerCache(
                k_blocks=self.kv_cache[layer, 0],
                v_blocks=self.kv_cache[layer, 1],
                k_slots=self.kv_cache[layer, 0].view(-1, s.num_kv_heads, s.head_dim),
                v_slots=self.kv_cache[layer, 1].view(-1, s.num_kv_heads, s.head_dim),
            )
            for layer in range(s.num_layers)
        ]
        # The native plan, held in C++ as well, for a fused decoder's calls (cpu_layer_call).
        self._native_step = (
            cpu_paged_attention.paged_attention_step(
                [c.k_blocks for c in self._layer_caches],
                [c.v_blocks for c in self._layer_caches],
                self.layers,
                s.head_dim,
                split_one_row=self._split_one_row,
            )
            if self.native
            else None
        )
        self._native_call = (
            None if self._native_step is None else tuple(self._native_step.layer_call())
        )
        self._prefill_kernel = self._use_prefill_kernel(self._prefill_choice)

    def _use_prefill_kernel(self, choice: str) -> bool:
        """Whether long prefill rows (an encoder's steps: all their prompts) go through
        cpu_prefill_attention: where it runs here (CPU, its head sizes, and for causal rows
        bf16 on avx512_bf16; an encoder's varlen entry also fp32 on avx512f or avx2) and, under
        auto, timed faster than SDPA."""
        if choice == "off":
            return False
        s = self.spec
        kernels = cpu_prefill_attention
        if self.bidirectional:
            usable = s.dtype in kernels.VARLEN_DTYPES and kernels.load_varlen(s.dtype)
            needs = "bfloat16 on a CPU with avx512_bf16 or float32 on one with avx512f or avx2"
        else:
            usable = s.dtype == torch.bfloat16 and kernels.load()
            needs = "bfloat16 on a CPU with avx512_bf16"
        usable = usable and self.device.type == "cpu" and s.head_dim in kernels.HEAD_DIMS
        if choice == "on":
            if not usable:
                raise ValueError(
                    f"prefill_kernel 'on' needs {needs}, and head_dim in {kernels.HEAD_DIMS}"
                )
            return True
        if not usable:
            return False
        if self.bidirectional:
            return kernels.varlen_faster_than_sdpa(s.num_heads, s.num_kv_heads, s.head_dim, s.dtype)
        return kernels.faster_than_sdpa(s.num_heads, s.num_kv_heads, s.head_dim)

    # ------------------------------------------------------------------ per step

    def prepare(self, batch: AttentionBatch) -> None:
        if self.native and not self._long_prefill(batch.query_start_loc):
            if self._native_step is None:
                raise RuntimeError("allocate_kv_cache() must run before prepare()")
            arrays = (batch.slot_mapping, batch.query_start_loc, batch.seq_lens, batch.block_table)
            self._native_step.plan(*(torch.from_numpy(np.asarray(a)) for a in arrays))
            self._plan = _StepPlan(int(batch.query_start_loc[-1]), native=True)
            return
        query_start = batch.query_start_loc.astype(np.int64)
        seq_lens = batch.seq_lens.astype(np.int64)
        query_lens = np.diff(query_start)
        if (seq_lens < query_lens).any():
            raise ValueError("a row has more query tokens than its seq_len")

        if self.bidirectional:
            self._plan = self._whole_prompts_plan(query_start, seq_lens)
            return
        slots = to_device(np.asarray(batch.slot_mapping, dtype=np.int64), self.device)
        decode_rows = np.flatnonzero(query_lens == 1)
        decodes = None
        if len(decode_rows):
            decodes = plan_decodes(
                query_start[decode_rows],
                seq_lens[decode_rows],
                batch.block_table[decode_rows],
                len(decode_rows) == len(query_lens),
                self.spec,
                self.windows,
            )
        prefills = tuple(
            plan_prefill(
                int(query_start[row]),
                int(query_start[row + 1]),
                int(seq_lens[row]),
                batch.block_table[row],
                self.spec,
                self.windows,
                self.bidirectional,
            )
            for row in np.flatnonzero(query_lens > 1)
        )
        self._plan = _StepPlan(int(query_start[-1]), False, slots, decodes, prefills)

    def _whole_prompts_plan(self, query_start: np.ndarray, seq_lens: np.ndarray) -> _StepPlan:
        """An encoder's step: each row a whole prompt (one token or more) attending over
        its own keys alone, all in one call of the varlen kernel where it runs. Nothing
        ever reads the cache, so nothing is written to it."""
        if self._prefill_kernel:
            if (np.diff(query_start) != seq_lens).any():
                raise ValueError(WHOLE_PROMPTS_ONLY)
            return _StepPlan(int(query_start[-1]), False, cu_seqlens=query_start.tolist())
        rows = (
            plan_prefill(
                int(query_start[row]),
                int(query_start[row + 1]),
                int(seq_lens[row]),
                _NO_BLOCKS,
                self.spec,
                self.windows,
                bidirectional=True,
            )
            for row in range(len(seq_lens))
        )
        return _StepPlan(int(query_start[-1]), False, prefills=tuple(rows))

    def _long_prefill(self, query_start_loc: np.ndarray) -> bool:
        """Whether a row prefills SDPA_MIN_QUERY_TOKENS or more."""
        limit = self._sdpa_min_query_tokens
        return limit is not None and bool((np.diff(query_start_loc) >= limit).any())

    def cpu_layer_call(self) -> tuple[int, int] | None:
        """The C++ kernel as a plugserve::LayerAttentionFn and its context (see
        interfaces.model.AttentionBackend), for the step prepared last; None where that step
        runs SDPA."""
        return self._native_call if self._plan is not None and self._plan.native else None

    # ------------------------------------------------------------------ per layer

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None or self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() and prepare() must run before forward()")
        if q.shape[0] != plan.num_tokens:
            raise ValueError(f"got {q.shape[0]} tokens, the prepared batch has {plan.num_tokens}")
        # (The cache holds the model's dtype: q, k and v need no casts.)
        if plan.native:  # the kernel writes k and v itself, then reads
            return self._native_step.forward(layer_idx, q, k, v)
        if plan.cu_seqlens is not None:
            return cpu_prefill_attention.varlen_bidirectional_attention(
                q,
                k,
                v,
                plan.cu_seqlens,
                self.scales[layer_idx],
                self.layers[layer_idx].logit_softcap,
            )
        cache = self._layer_caches[layer_idx]
        # Written before any read, so a row sees the tokens every row adds this step.
        if plan.slots is not None:
            cache.k_slots.index_copy_(0, plan.slots, k)
            cache.v_slots.index_copy_(0, plan.slots, v)
        if plan.decodes is not None and plan.decodes.token_index is None:
            return self._decode(layer_idx, cache, q, plan.decodes)
        if plan.decodes is None and len(plan.prefills) == 1:  # one prompt: no copy into `out`
            return self._prefill(layer_idx, cache, q, k, v, plan.prefills[0]).contiguous()
        out = torch.empty_like(q)
        if plan.decodes is not None:
            d = plan.decodes
            out[d.token_index] = self._decode(layer_idx, cache, q[d.token_index], d)
        for p in plan.prefills:
            out[p.start : p.end] = self._prefill(layer_idx, cache, q, k, v, p)
        return out

    def _prefill(
        self,
        layer_idx: int,
        cache: _LayerCache,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: PrefillRow,
    ) -> torch.Tensor:
        """The rows [p.start, p.end) of one request's prefill chunk → [rows, H, D]."""
        layer = self.layers[layer_idx]
        if p.block_ids is None:
            keys, values = k[p.start : p.end], v[p.start : p.end]
        else:
            keys = self._gather(cache.k_blocks, p.block_ids)[: p.seq_len]
            values = self._gather(cache.v_blocks, p.block_ids)[: p.seq_len]
        if self._prefill_kernel:  # causal from the row's context_len, in the kernel
            return cpu_prefill_attention.prefill_attention(
                q[p.start : p.end],
                keys,
                values,
                self.scales[layer_idx],
                layer.logit_softcap,
                layer.sliding_window,
            )
        o = sdpa_attention(
            q[p.start : p.end].transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            mask=p.masks[layer.sliding_window],
            scale=self.scales[layer_idx],
            softcap=layer.logit_softcap,
            causal=not layer.bidirectional,
        )
        return o[0].transpose(0, 1)

    def _decode(
        self, layer_idx: int, cache: _LayerCache, q: torch.Tensor, d: DecodeRows
    ) -> torch.Tensor:
        """q [B, H, D], one query per row → [B, H, D]."""
        s = self.spec
        rows, num_blocks = d.block_table.shape
        context = num_blocks * s.block_size
        block_ids = d.block_table.view(-1)

        def gather(blocks: torch.Tensor) -> torch.Tensor:  # → [B, KVH, L, D]
            tokens = self._gather(blocks, block_ids)
            return tokens.view(rows, context, s.num_kv_heads, s.head_dim).transpose(1, 2)

        # Each KV head's group of query heads as the query-length dimension.
        layer = self.layers[layer_idx]
        o = sdpa_attention(
            q.view(rows, s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim),
            gather(cache.k_blocks),
            gather(cache.v_blocks),
            mask=d.biases[layer.sliding_window],
            scale=self.scales[layer_idx],
            softcap=layer.logit_softcap,
        )
        return o.reshape(rows, s.num_heads, s.head_dim)

    def _gather(self, blocks: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The tokens of the given blocks, in order: [len(block_ids) * block_size, KVH, D]."""
        s = self.spec
        return blocks.index_select(0, block_ids).view(-1, s.num_kv_heads, s.head_dim)


@hookimpl
def register_attention_backends(register: Register) -> None:
    register("torch", TorchPagedAttention)
