"""The model runner's CUDA-only pieces: KV pool sizing by profiling, pinned step inputs.

Nothing here runs on CPU, where `engine.kv_cache_memory` sizes the pool and step inputs
are plain numpy-backed tensors.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from plugserve.interfaces.model import AttentionBatch

logger = logging.getLogger(__name__)


def dummy_prefill_batch(num_tokens: int, max_rows: int, block_size: int) -> AttentionBatch:
    """`num_tokens` tokens of fresh prefills over min(max_rows, num_tokens) rows of
    near-equal length, each row on its own consecutive blocks starting at block 0."""
    rows = min(max_rows, num_tokens)
    lens = np.full(rows, num_tokens // rows, dtype=np.int64)
    lens[: num_tokens % rows] += 1
    pages = -(-lens // block_size)
    cu_query = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(lens, out=cu_query[1:])
    first_page = np.concatenate([[0], np.cumsum(pages)[:-1]])
    # Past a row's own pages the table runs into the next row's: never read (seq_lens).
    block_table = (first_page[:, None] + np.arange(pages.max())[None, :]).astype(np.int32)
    positions = np.arange(num_tokens) - np.repeat(cu_query[:-1], lens)
    token_rows = np.repeat(np.arange(rows), lens)
    slots = block_table[token_rows, positions // block_size].astype(np.int64)
    return AttentionBatch(
        query_start_loc=cu_query,
        seq_lens=lens.astype(np.int32),
        block_table=block_table,
        slot_mapping=slots * block_size + positions % block_size,
    )


@torch.inference_mode()
def profile_kv_budget(
    model: Any,
    attention: Any,
    *,
    num_tokens: int,
    max_rows: int,
    block_size: int,
    device: torch.device,
    utilization: float,
    computes_logits: bool = True,
) -> int:
    """Bytes the KV pool may take: `utilization` of the device's memory, less everything
    in use on it now (weights, CUDA context, workspaces, other processes), less the
    activation peak of one forward pass over a full step of fresh prefills (the largest
    step the scheduler can form) and its logits, where it `computes_logits` (a pooling
    model has no head).

    Leaves a throwaway KV pool allocated, sized for the dummy step; it is counted as in
    use, so the real pool fits beside it until it replaces it."""
    batch = dummy_prefill_batch(num_tokens, max_rows, block_size)
    attention.allocate_kv_cache(int(batch.block_table[:, -1].max()) + 1)
    positions = np.arange(num_tokens) - np.repeat(batch.query_start_loc[:-1], batch.query_lens)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    attention.prepare(batch)
    hidden = model(
        torch.zeros(num_tokens, dtype=torch.int64, device=device),
        torch.from_numpy(positions).to(device),
    )
    if computes_logits:
        index = torch.from_numpy(batch.query_start_loc[1:].astype(np.int64) - 1).to(device)
        model.compute_logits(hidden[index])
    del hidden
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    activation_peak = peak - torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(utilization * total) - (total - free) - activation_peak
    gib = 1 << 30
    logger.info(
        "GPU memory: %.1f GiB total, %.1f GiB in use, activation peak %.2f GiB -> %.2f GiB "
        "for the KV cache (gpu_memory_utilization %.2f)",
        total / gib,
        (total - free) / gib,
        activation_peak / gib,
        budget / gib,
        utilization,
    )
    return budget


class PinnedStaging:
    """Pinned host buffers for a step's int64 inputs, copied without blocking the host.

    The previous step's copies must have read the buffers before they are rewritten; an
    event recorded after them says when. A step where no row samples never synchronizes,
    so without the event the host could overwrite inputs still waiting to be copied.
    """

    def __init__(self, *sizes: int) -> None:
        self._buffers = [torch.empty(n, dtype=torch.int64, pin_memory=True) for n in sizes]
        self._copied = torch.cuda.Event()

    def to_device(self, arrays: tuple[np.ndarray, ...], device: torch.device) -> list[torch.Tensor]:
        if any(len(a) > len(b) for a, b in zip(arrays, self._buffers, strict=True)):
            # Larger than the scheduler's budget allows; stay correct, if slower.
            return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]
        self._copied.synchronize()
        out = []
        for array, buffer in zip(arrays, self._buffers, strict=True):
            staged = buffer[: len(array)]
            staged.numpy()[:] = array
            out.append(staged.to(device, non_blocking=True))
        self._copied.record()
        return out
