"""A third-party attention backend, the smallest real one: the paged K/V cache is one
torch tensor per layer, and each request's context is gathered from its blocks and
attended with torch's scaled_dot_product_attention. Full causal attention only (it does
not declare capabilities.HonoursLayerAttention), one request at a time.

Loaded through PLUGSERVE_PLUGIN_MODULES=tests.plugins.minimal.attention;
tests/plugins/test_minimal_plugins.py selects it.
"""

from __future__ import annotations

import numpy as np
import torch

from plugserve import hookimpl
from plugserve.hookspecs import Register
from plugserve.interfaces.model import AttentionBatch, AttentionSpec


class GatherAttention:
    """interfaces.model.AttentionBackend: gather each request's context, then SDPA."""

    def __init__(self, *, spec: AttentionSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        self.kv_cache: torch.Tensor | None = None
        self._slot_mapping = torch.empty(0, dtype=torch.long)
        # Per request of the step: its rows in the flat token axis, and its context's slots.
        self._rows: list[tuple[int, int, torch.Tensor]] = []

    def kv_cache_bytes_per_block(self) -> int:
        s = self.spec
        element = torch.empty((), dtype=s.dtype).element_size()
        return 2 * s.num_layers * s.block_size * s.num_kv_heads * s.head_dim * element

    def allocate_kv_cache(self, num_blocks: int) -> None:
        s = self.spec
        # Zeros: a NaN in memory never written would reach the output through 0 * NaN.
        shape = (s.num_layers, 2, num_blocks * s.block_size, s.num_kv_heads, s.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=s.dtype, device=self.device)

    def prepare(self, batch: AttentionBatch) -> None:
        size = self.spec.block_size
        self._slot_mapping = torch.from_numpy(np.asarray(batch.slot_mapping, dtype=np.int64))
        self._rows = []
        for i in range(batch.num_reqs):
            context = int(batch.seq_lens[i])
            blocks = torch.from_numpy(batch.block_table[i, : -(-context // size)].astype(np.int64))
            slots = (blocks[:, None] * size + torch.arange(size)).flatten()[:context]
            start, end = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
            self._rows.append((start, end, slots.to(self.device)))
        self._slot_mapping = self._slot_mapping.to(self.device)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        assert self.kv_cache is not None, "allocate_kv_cache() runs before forward()"
        keys, values = self.kv_cache[layer_idx]
        keys[self._slot_mapping] = k
        values[self._slot_mapping] = v
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        for start, end, slots in self._rows:
            num_queries, context = end - start, len(slots)
            # Query j sits at position context - num_queries + j and sees keys up to it.
            mask = torch.ones(num_queries, context, dtype=torch.bool, device=self.device)
            mask = mask.tril(diagonal=context - num_queries)
            out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                keys[slots].repeat_interleave(group, dim=1).transpose(0, 1),
                values[slots].repeat_interleave(group, dim=1).transpose(0, 1),
                attn_mask=mask,
            ).transpose(0, 1)
        return out


@hookimpl
def register_attention_backends(register: Register) -> None:
    register("gather", GatherAttention)
