"""Loads the C++ paged-attention kernel (cpu_paged_attention.cpp).

On CPU, attending a decode row through SDPA first copies its context out of the paged
cache (index_select), then reads the copy again; at batch 32 that copying and SDPA's
small-query overheads were a third of a decode step. The kernel reads K and V in place,
block by block, one query token per row; prefill tokens are rows too (causal by their
seq_len), which also beats SDPA's CPU kernel on short prompts.

It is compiled once per machine by plugserve.worker.cpp_extension; where that fails the
torch backend keeps SDPA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from plugserve.worker import cpp_extension

_SOURCE = Path(__file__).with_suffix(".cpp")


def load() -> bool:
    """Make torch.ops.plugserve_cpu.paged_attention available; False (with the reason
    logged once) if it cannot be built or loaded here."""
    return cpp_extension.load(_SOURCE)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_table: torch.Tensor,
    table_index: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Writes this step's k and v [T, KVH, D] into cache slots `slots` [T], then one query
    per row: q [R, H, D] attends to the first seq_lens[r] tokens of block-table row
    table_index[r]. K/V blocks [num_blocks, block_size, KVH, D]; block_table
    [requests, max_blocks], table_index and seq_lens [R], all int64 → [R, H, D]."""
    return torch.ops.plugserve_cpu.paged_attention(
        q, k, v, slots, k_blocks, v_blocks, block_table, table_index, seq_lens, scale
    )


def paged_attention_step(
    k_blocks: list[torch.Tensor], v_blocks: list[torch.Tensor], scale: float
) -> Any:
    """Each layer's K/V blocks and, after `plan(slots, block_table, table_index, seq_lens)`,
    a step's plan, in C++: `layer_call()` gives [function, context] addresses of the
    kernel as a plugserve::LayerAttentionFn (layer_attention.h) over them."""
    return torch.classes.plugserve_cpu.PagedAttentionStep(k_blocks, v_blocks, scale)
