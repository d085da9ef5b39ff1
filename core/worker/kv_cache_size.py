"""The KV pool's size in blocks, chosen once at start-up by the model runner."""

from __future__ import annotations

from typing import Any

import torch

from plugserve.config import EngineConfig
from plugserve.interfaces.model import AttentionBackend
from plugserve.worker.cuda_path import profile_kv_budget


def num_kv_blocks(
    engine: EngineConfig,
    attention: AttentionBackend,
    model: Any,
    device: torch.device,
    max_model_len: int,
) -> int:
    """How many KV blocks the pool holds: engine.num_kv_blocks where set, else what
    engine.kv_cache_memory (CPU) or the memory a profiling pass leaves under
    engine.gpu_memory_utilization (CUDA) fits, but no more than every sequence at full
    length can use; a ValueError naming the setting where fewer than 2 fit."""
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    per_block = attention.kv_cache_bytes_per_block()
    if device.type == "cuda":
        budget = profile_kv_budget(
            model,
            attention,
            num_tokens=min(engine.max_num_batched_tokens, engine.max_num_seqs * max_model_len),
            max_rows=engine.max_num_seqs,
            block_size=engine.block_size,
            device=device,
            utilization=engine.gpu_memory_utilization,
        )
        setting = f"engine.gpu_memory_utilization ({engine.gpu_memory_utilization})"
    else:
        budget = int(engine.kv_cache_memory)
        setting = f"engine.kv_cache_memory ({budget} bytes)"
    num_blocks = max(budget, 0) // per_block
    # More blocks than every sequence at full length can use is wasted memory.
    useful = engine.max_num_seqs * -(-max_model_len // engine.block_size) + 1
    num_blocks = min(num_blocks, useful)
    if num_blocks < 2:
        raise ValueError(
            f"{setting} leaves room for fewer than 2 KV blocks of {per_block} bytes; raise it"
        )
    return num_blocks
