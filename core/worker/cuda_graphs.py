"""CUDA graphs for pure-decode steps (`engine.cuda_graphs`).

A decode step of an 8B model is a few hundred small kernel launches; replaying them as
one captured graph removes the Python and launch overhead that otherwise dominates at
small batch sizes. Only steps whose every row decodes one token are replayed, padded up
to the nearest captured batch size; every other step runs eagerly.

What a graph captures is fixed: tensor addresses and launch shapes. So the model reads
its token ids and positions from static buffers owned here, and the attention backend
must write each step's metadata into static buffers of its own. A backend opts in with
two methods, capabilities.SupportsCudaGraphs (FlashInferAttention has them; the torch
backend does not, as its kernels' shapes follow each step's longest context):

- `init_cuda_graphs(sizes, max_blocks_per_req)`: allocate those buffers, once, after
  `allocate_kv_cache`;
- `prepare_graph(batch, padded_size)`: like `prepare`, for a batch of one-token rows
  padded with rows that touch only scratch KV memory; an empty batch is all padding.

Graphs run only without tensor parallelism (collectives stay out of captures).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import numpy as np
import torch

from plugserve.capabilities import supports_cuda_graphs
from plugserve.interfaces.model import AttentionBatch

logger = logging.getLogger(__name__)


def cuda_graphs_enabled(
    setting: bool | None,
    device: torch.device,
    attention: Any,
    *,
    attention_name: str,
    world_size: int,
) -> bool:
    """`engine.cuda_graphs` resolved: None means on where they can run; true where they
    cannot is an error naming why."""
    if device.type != "cuda":
        reason = f"the engine runs on {device.type}"
    elif not supports_cuda_graphs(attention):
        reason = f"attention {attention_name!r} does not support them"
    elif world_size > 1:
        reason = "tensor parallelism keeps collectives out of captures"
    else:
        return setting is not False
    if setting:
        raise ValueError(f"engine.cuda_graphs is true but {reason}")
    if setting is None and device.type == "cuda":
        logger.info("CUDA graphs off (%s): decode steps run eagerly", reason)
    return False


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to max_num_seqs (always included):
    padding wastes at most 15 rows while the number of graphs stays small."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def _empty_batch() -> AttentionBatch:
    return AttentionBatch(
        query_start_loc=np.zeros(1, dtype=np.int32),
        seq_lens=np.zeros(0, dtype=np.int32),
        block_table=np.zeros((0, 1), dtype=np.int32),
        slot_mapping=np.zeros(0, dtype=np.int64),
    )


class DecodeGraphs:
    """Captured decode graphs, one per padded batch size, sharing one memory pool."""

    def __init__(
        self,
        model: torch.nn.Module,
        attention: Any,
        *,
        max_num_seqs: int,
        max_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        if not supports_cuda_graphs(attention):
            raise ValueError(f"{type(attention).__name__} does not support CUDA graphs")
        self.model = model
        self.attention = attention
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks_per_req = max_blocks_per_req
        largest = self.sizes[-1]
        # Any leftover values are valid ids and positions, so padded rows need no reset.
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.attention.init_cuda_graphs(self.sizes, self.max_blocks_per_req)
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs then fit in the memory the larger one freed.
        for size in reversed(self.sizes):
            self.attention.prepare_graph(_empty_batch(), size)
            # An eager run first: lazy initialisation (cuBLAS handles, FlashInfer's
            # module load, cached constants) must not happen inside a capture.
            self.model(self.input_ids[:size], self.positions[:size])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(self.input_ids[:size], self.positions[:size])
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def padded_size(self, query_lens: np.ndarray) -> int | None:
        """The captured size a step would replay at, or None to run it eagerly."""
        if not self._graphs or len(query_lens) == 0 or (query_lens != 1).any():
            return None
        i = bisect.bisect_left(self.sizes, len(query_lens))
        return self.sizes[i] if i < len(self.sizes) else None

    def run(
        self, batch: AttentionBatch, size: int, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Plan the attention for `batch` padded to `size`, replay, and return the hidden
        states of the real rows (a view of the graph's output: use it before the next
        replay)."""
        n = len(input_ids)
        self.attention.prepare_graph(batch, size)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        graph, hidden = self._graphs[size]
        graph.replay()
        return hidden[:n]
