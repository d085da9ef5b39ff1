"""Loads the C++ paged-attention kernel (cpu_paged_attention.cpp).

On CPU, attending a decode row through SDPA first copies its context out of the paged
cache (index_select), then reads the copy again; at batch 32 that copying and SDPA's
small-query overheads were a third of a decode step. The kernel reads K and V in place,
block by block, one query token per row; prefill tokens are rows too (causal by their
seq_len), which also beats SDPA's CPU kernel on short prompts. Each layer's scale,
logit soft-cap and sliding window (interfaces.model.LayerAttention) apply in the kernel: a
windowed row reads only its last `sliding_window` tokens.

It is compiled once per machine by plugserve.ops; where that fails the
torch backend keeps SDPA.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from plugserve import ops
from plugserve.interfaces.model import LayerAttention

_SOURCE = Path(__file__).with_suffix(".cpp")


def load() -> bool:
    """Make torch.classes.plugserve_cpu.PagedAttentionStep available; False (with the
    reason logged once) if it cannot be built or loaded here."""
    return ops.load(_SOURCE)


def unavailable_reason() -> str | None:
    """None where the kernel is built and loaded (load()), else why it is not."""
    return ops.unavailable_reason(_SOURCE)


def paged_attention_step(
    k_blocks: list[torch.Tensor],
    v_blocks: list[torch.Tensor],
    layers: Sequence[LayerAttention],
    head_dim: int,
    *,
    split_one_row: bool = True,
) -> Any:
    """The kernel over each layer's K/V blocks [num_blocks, block_size, KVH, D], each layer
    attending as its LayerAttention says (scale, soft-cap, sliding window).

    `plan(slot_mapping, query_start, seq_lens, block_table)` takes a step's
    interfaces.model.AttentionBatch arrays (as tensors); then `forward(layer, q, k, v)` writes the
    step's k and v [T, KVH, D] into the cache and attends q [T, H, D] → [T, H, D], and
    `layer_call()` gives [function, context] addresses of the same kernel as a
    plugserve::LayerAttentionFn (layer_attention.h). `split_one_row`: a step of one row
    may split its context with the row pool's helper (faster at batch 1; False keeps every
    row's sums in the order a row of a larger step has, for engine.batch_invariant)."""
    return torch.classes.plugserve_cpu.PagedAttentionStep(
        k_blocks,
        v_blocks,
        [layer.softmax_scale(head_dim) for layer in layers],
        [layer.logit_softcap or 0.0 for layer in layers],  # 0: none
        [layer.sliding_window or 0 for layer in layers],  # 0: the whole context
        split_one_row,
    )
