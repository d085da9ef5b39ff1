"""FlashInfer paged attention (CUDA only): `stack.attention: flashinfer`.

KV cache: one tensor [num_layers, 2 (K, V), num_blocks + 1, block_size, num_kv_heads,
head_dim], the torch backend's layout; per layer, K and V are each FlashInfer's "NHD"
page layout [pages, page_size, kv_heads, head_dim] and are handed to it as a pair. The
extra last page is scratch: padded rows of a CUDA-graph batch write and read only it.

Per step, `prepare` turns the host batch into FlashInfer's CSR page table with numpy
(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len) and plans one
`BatchPrefillWithPagedKVCacheWrapper` for the whole flat varlen batch with causal=True
(bottom-right aligned, so a row of q queries over kv keys sees keys 0..kv-q+i): prefill
chunks, prefix-cached context and decodes mix in one plan. `plan` copies the metadata to
the device once; every layer's `forward` then writes its K/V at the step's slots
(index_copy_, no extra JIT module) and runs. There is no separate decode wrapper: the
prefill kernel packs a GQA group's heads into its query tile, which is what FlashInfer's
decode wrapper does with use_tensor_cores=True.

Layers that attend differently (interfaces.model.LayerAttention: a sliding window, logit
soft-capping, another softmax scale) get one wrapper per distinct option set, each
planned every step with its window_left (window - 1: FlashInfer's left bound is
inclusive of the query's own position), logits_soft_cap and sm_scale; a layer runs the
wrapper of its set. Gemma 2 plans two (its sliding and its global layers), Llama one.

flashinfer is imported only when the backend is built, so this module imports anywhere;
`unavailable_reason()` says why it cannot run on this machine.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from plugserve import hookimpl
from plugserve.hookspecs import Register
from plugserve.interfaces.model import AttentionBatch, AttentionSpec, LayerAttention

NAME = "flashinfer"
INSTALL_HINT = "flashinfer-python is not installed (pip install -e .[gpu])"


class FlashInferOptions(BaseModel):
    """`plugins.flashinfer` in stack.yaml."""

    model_config = ConfigDict(extra="forbid")

    # fa2: one JIT-compiled module per head size, the one CUDA graphs use anyway. auto
    # lets FlashInfer pick FA3 on Hopper for eager steps (a second module to compile).
    backend: Literal["fa2", "fa3", "auto"] = "fa2"
    # Split-KV partial results; 256 MiB covers 256 decode rows of 32 heads of 128.
    workspace_mib: int = Field(256, ge=16)


@dataclass(frozen=True)
class PagedMetadata:
    """One step's page table in FlashInfer's CSR form, on the host (int32 numpy)."""

    qo_indptr: np.ndarray  # [rows + 1]: row i's queries are qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: np.ndarray  # [rows + 1]: row i's pages are kv_indices[kv_indptr[i]:...]
    kv_indices: np.ndarray  # [total pages]
    last_page_len: np.ndarray  # [rows]: tokens in each row's last page, 1..page_size

    @property
    def num_rows(self) -> int:
        return len(self.last_page_len)


def paged_metadata(batch: AttentionBatch, block_size: int) -> PagedMetadata:
    """The batch's page table: each row's first ceil(seq_len / block_size) blocks."""
    query_lens = np.diff(batch.query_start_loc.astype(np.int64))
    seq_lens = batch.seq_lens.astype(np.int64)
    if (query_lens < 1).any() or (seq_lens < query_lens).any():
        raise ValueError("every row needs 1 <= query_len <= seq_len")
    num_pages = -(-seq_lens // block_size)
    table = np.asarray(batch.block_table)
    if len(seq_lens) and table.shape[1] < num_pages.max():
        raise ValueError("block_table holds fewer blocks than seq_lens need")
    kv_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=kv_indptr[1:])
    # Boolean indexing walks rows in order, so this is the rows' page lists concatenated.
    used = np.arange(table.shape[1])[None, :] < num_pages[:, None]
    return PagedMetadata(
        qo_indptr=batch.query_start_loc.astype(np.int32),
        kv_indptr=kv_indptr,
        kv_indices=table[used].astype(np.int32),
        last_page_len=(seq_lens - (num_pages - 1) * block_size).astype(np.int32),
    )


def pad_decode_rows(meta: PagedMetadata, rows: int, scratch_page: int) -> PagedMetadata:
    """Append one-token rows that attend only over the scratch page, up to `rows`."""
    extra = rows - meta.num_rows
    if extra < 0:
        raise ValueError(f"{meta.num_rows} rows do not fit a batch of {rows}")
    if len(meta.qo_indptr) - 1 != int(meta.qo_indptr[-1]):
        raise ValueError("only a batch of one-token rows can be padded")
    return PagedMetadata(
        qo_indptr=np.arange(rows + 1, dtype=np.int32),
        kv_indptr=np.concatenate(
            [meta.kv_indptr, meta.kv_indptr[-1] + np.arange(1, extra + 1, dtype=np.int32)]
        ),
        kv_indices=np.concatenate([meta.kv_indices, np.full(extra, scratch_page, np.int32)]),
        last_page_len=np.concatenate([meta.last_page_len, np.ones(extra, np.int32)]),
    )


@dataclass(frozen=True)
class _Step:
    # Planned flashinfer.BatchPrefillWithPagedKVCacheWrappers, one per option set
    # (FlashInferAttention.option_sets), in that order.
    wrappers: tuple[Any, ...]
    slots: torch.Tensor  # [num_tokens] int64: where each token's K/V goes
    num_tokens: int


def plan_options(layer: LayerAttention, head_dim: int) -> dict[str, Any]:
    """A layer's options as FlashInfer's plan() takes them. window_left counts the keys
    left of the query's own position (-1: no window), so a window of W tokens, the query
    included, is W - 1."""
    return {
        "sm_scale": layer.softmax_scale(head_dim),
        "window_left": -1 if layer.sliding_window is None else layer.sliding_window - 1,
        "logits_soft_cap": layer.logit_softcap,
    }


class FlashInferAttention:
    """interfaces.model.AttentionBackend on FlashInfer's batch prefill kernels; also implements
    the optional CUDA-graph hooks of plugserve.worker.cuda_graphs."""

    Options = FlashInferOptions
    # capabilities.HonoursLayerAttention: plan() takes all three.
    layer_attention_options = frozenset({"sliding_window", "logit_softcap", "scale"})
    # The model dtypes its kernels compute in (float32 is refused at start).
    dtypes = ("bfloat16", "float16")

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine, or None. Cheap: the package is
        located, not imported."""
        if not torch.cuda.is_available():
            return "needs CUDA (torch.cuda.is_available() is False)"
        if importlib.util.find_spec("flashinfer") is None:
            return INSTALL_HINT
        return None

    def __init__(self, *, spec: AttentionSpec, options: FlashInferOptions | None = None) -> None:
        reason = self.unavailable_reason()
        if reason:
            raise ValueError(f"attention {NAME!r} cannot run here: {reason}")
        options = options or FlashInferOptions()
        device = torch.device(spec.device)
        if device.type != "cuda":
            raise ValueError(f"attention {NAME!r} needs engine.device cuda, not {device.type}")
        if str(spec.dtype).removeprefix("torch.") not in self.dtypes:
            raise ValueError(
                f"attention {NAME!r} runs in bfloat16 or float16, not "
                f"{str(spec.dtype).removeprefix('torch.')}; set engine.dtype"
            )
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"num_heads ({spec.num_heads}) must be a multiple of "
                f"num_kv_heads ({spec.num_kv_heads})"
            )
        try:
            import flashinfer
        except Exception as exc:  # a broken install must still fail with one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"attention {NAME!r}: importing flashinfer failed: {first}") from exc
        self._flashinfer: Any = flashinfer
        self.spec = spec
        self.device = device
        self.options = options
        # The distinct option sets of the layers, and each layer's index among them.
        layers = [spec.layer(i) for i in range(spec.num_layers)]
        self.option_sets: tuple[LayerAttention, ...] = tuple(dict.fromkeys(layers))
        self._set_of_layer = [self.option_sets.index(layer) for layer in layers]
        # One workspace for every wrapper: they run one at a time on one stream.
        self._workspace = torch.empty(options.workspace_mib << 20, dtype=torch.uint8, device=device)
        self._wrappers = tuple(
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", backend=options.backend
            )
            for _ in self.option_sets
        )
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self._step: _Step | None = None
        # plan() stages its tables in pinned host memory that the next plan() rewrites;
        # waiting for the previous step's copies first keeps the host at most one step
        # ahead of the device (steps where nobody samples do not synchronize otherwise).
        self._planned = torch.cuda.Event()
        self._graph_wrappers: dict[int, tuple[Any, ...]] = {}
        self._graph_slots: torch.Tensor | None = None

    def kv_cache_bytes_per_block(self) -> int:
        s = self.spec
        element = torch.empty((), dtype=s.dtype).element_size()
        return 2 * s.num_layers * s.block_size * s.num_kv_heads * s.head_dim * element

    def allocate_kv_cache(self, num_blocks: int) -> None:
        s = self.spec
        self.kv_cache = None  # the old pool goes before the new one is taken
        self.num_blocks = num_blocks
        # Zeros, not empty: a NaN in memory no row has written must never reach a kernel.
        self.kv_cache = torch.zeros(
            (s.num_layers, 2, num_blocks + 1, s.block_size, s.num_kv_heads, s.head_dim),
            dtype=s.dtype,
            device=self.device,
        )

    # ------------------------------------------------------------------ per step

    def prepare(self, batch: AttentionBatch) -> None:
        self._planned.synchronize()
        meta = paged_metadata(batch, self.spec.block_size)
        self._plan(self._wrappers, meta)
        slots = torch.from_numpy(np.ascontiguousarray(batch.slot_mapping, dtype=np.int64))
        # From pageable memory the copy is staged before it returns: the array may change.
        self._step = _Step(
            self._wrappers, slots.to(self.device, non_blocking=True), int(meta.qo_indptr[-1])
        )
        self._planned.record()

    def _plan(self, wrappers: tuple[Any, ...], meta: PagedMetadata) -> None:
        """Plan each option set's wrapper over the same page table."""
        s = self.spec
        for wrapper, layer in zip(wrappers, self.option_sets, strict=True):
            # Host tensors: plan() reads them on the host and copies them to the device.
            wrapper.plan(
                torch.from_numpy(meta.qo_indptr),
                torch.from_numpy(meta.kv_indptr),
                torch.from_numpy(meta.kv_indices),
                torch.from_numpy(meta.last_page_len),
                s.num_heads,
                s.num_kv_heads,
                s.head_dim,
                s.block_size,
                causal=True,
                q_data_type=s.dtype,
                kv_data_type=s.dtype,
                # Known here; spares plan() a Python loop over the rows.
                max_token_per_sequence=int(np.diff(meta.qo_indptr).max(initial=1)),
                **plan_options(layer, s.head_dim),
            )

    # ------------------------------------------------------------------ per layer

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        step = self._step
        if step is None or self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() and prepare() must run before forward()")
        if q.shape[0] != step.num_tokens:
            raise ValueError(f"got {q.shape[0]} tokens, the prepared batch has {step.num_tokens}")
        s = self.spec
        k_cache, v_cache = self.kv_cache[layer_idx, 0], self.kv_cache[layer_idx, 1]
        # Written before the kernel reads, so a row sees the tokens it adds this step.
        k_cache.view(-1, s.num_kv_heads, s.head_dim).index_copy_(0, step.slots, k.to(s.dtype))
        v_cache.view(-1, s.num_kv_heads, s.head_dim).index_copy_(0, step.slots, v.to(s.dtype))
        q = q.contiguous()  # q may be a strided view of the fused QKV output
        out = torch.empty_like(q)
        step.wrappers[self._set_of_layer[layer_idx]].run(q, (k_cache, v_cache), out=out)
        return out

    # ------------------------------------------------------------------ CUDA graphs

    def init_cuda_graphs(self, sizes: Sequence[int], max_blocks_per_req: int) -> None:
        """One graph-mode wrapper per padded decode batch size. Their tables live in
        fixed device buffers (shared: each replay is preceded by its own plan), so a
        captured kernel reads whatever the latest `prepare_graph` wrote."""
        if self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() must run before init_cuda_graphs()")
        largest = max(sizes)
        device, i32 = self.device, torch.int32
        self._graph_slots = torch.zeros(largest, dtype=torch.int64, device=device)
        qo_indptr = torch.zeros(largest + 1, dtype=i32, device=device)
        kv_indptr = torch.zeros(largest + 1, dtype=i32, device=device)
        # +1 page per row: a padded row holds the scratch page.
        kv_indices = torch.zeros(largest * (max_blocks_per_req + 1), dtype=i32, device=device)
        last_page_len = torch.zeros(largest, dtype=i32, device=device)
        for size in sizes:
            # fa2 whatever the eager backend: its graph-mode plan keeps the launch
            # shape fixed for a batch size, which a captured launch needs. One per
            # option set, all reading the same table buffers.
            self._graph_wrappers[size] = tuple(
                self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace,
                    "NHD",
                    use_cuda_graph=True,
                    qo_indptr_buf=qo_indptr[: size + 1],
                    paged_kv_indptr_buf=kv_indptr[: size + 1],
                    paged_kv_indices_buf=kv_indices,
                    paged_kv_last_page_len_buf=last_page_len[:size],
                    backend="fa2",
                )
                for _ in self.option_sets
            )

    def prepare_graph(self, batch: AttentionBatch, padded_size: int) -> None:
        """Like prepare() for a batch of one-token rows, padded to `padded_size` rows
        that write and read the scratch page; fills the fixed buffers a captured
        graph of that size reads. An empty batch is all padding (used to capture)."""
        wrappers = self._graph_wrappers.get(padded_size)
        if wrappers is None or self._graph_slots is None:
            raise ValueError(f"no CUDA-graph wrapper for batch size {padded_size}")
        self._planned.synchronize()
        meta = pad_decode_rows(
            paged_metadata(batch, self.spec.block_size), padded_size, self.num_blocks
        )
        slots = np.full(padded_size, self.num_blocks * self.spec.block_size, dtype=np.int64)
        slots[: batch.num_reqs] = batch.slot_mapping
        graph_slots = self._graph_slots[:padded_size]
        graph_slots.copy_(torch.from_numpy(slots), non_blocking=True)
        self._plan(wrappers, meta)
        self._step = _Step(wrappers, graph_slots, padded_size)
        self._planned.record()


@hookimpl
def register_attention_backends(register: Register) -> None:
    register(NAME, FlashInferAttention)
