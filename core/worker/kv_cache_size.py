"""The KV pool's size in blocks, chosen once at start-up by the model runner."""

from __future__ import annotations

from typing import Any

import torch

from plugserve.config import EngineConfig
from plugserve.interfaces.model import AttentionBackend
from plugserve.pooling_setup import PoolingSetup
from plugserve.worker.cuda_path import profile_kv_budget


def num_kv_blocks(
    engine: EngineConfig,
    attention: AttentionBackend,
    model: Any,
    device: torch.device,
    max_model_len: int,
    pooling: PoolingSetup,
    extra_bytes_per_block: int = 0,
) -> int:
    """How many KV blocks the pool holds: engine.num_kv_blocks where set, else what
    engine.kv_cache_memory (CPU) or the memory a profiling pass leaves under
    engine.gpu_memory_utilization (CUDA) fits, but no more than every sequence at full
    length can use, or, for an encoder (`pooling`), than one step can
    (whole_prompt_blocks); a ValueError naming the setting where fewer than 2 fit.
    `extra_bytes_per_block`: what another cache addressed by the same block ids takes per
    block (a worker-side speculative proposer's model)."""
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    per_block = attention.kv_cache_bytes_per_block() + extra_bytes_per_block
    if device.type == "cuda":
        budget = profile_kv_budget(
            model,
            attention,
            num_tokens=min(engine.max_num_batched_tokens, engine.max_num_seqs * max_model_len),
            max_rows=engine.max_num_seqs,
            block_size=engine.block_size,
            device=device,
            utilization=engine.gpu_memory_utilization,
            computes_logits=not pooling.is_pooling,
        )
        setting = f"engine.gpu_memory_utilization ({engine.gpu_memory_utilization})"
    else:
        budget = int(engine.kv_cache_memory)
        setting = f"engine.kv_cache_memory ({budget} bytes)"
    num_blocks = max(budget, 0) // per_block
    # More blocks than every sequence at full length can use is wasted memory.
    useful = engine.max_num_seqs * -(-max_model_len // engine.block_size) + 1
    if pooling.is_encoder:
        useful = min(useful, whole_prompt_blocks(engine, max_model_len))
    num_blocks = min(num_blocks, useful)
    if num_blocks < 2:
        raise ValueError(
            f"{setting} leaves room for fewer than 2 KV blocks of {per_block} bytes; raise it"
        )
    return num_blocks


def whole_prompt_blocks(engine: EngineConfig, max_model_len: int) -> int:
    """The most blocks one step of an encoder can fill. Its prompts run whole in the step
    that admits them and free their blocks when it ends, so no block outlives a step,
    and a step holds at most max_num_batched_tokens tokens in at most max_num_seqs
    prompts, each rounded up to whole blocks: the most blocks are n one-token prompts and
    the rest of the budget in full blocks. Never fewer than a max_model_len prompt needs,
    so the engine does not cap the context at the pool."""
    budget = engine.max_num_batched_tokens
    num_prompts = min(engine.max_num_seqs, budget)
    one_step = num_prompts + (budget - num_prompts) // engine.block_size
    return max(one_step, -(-max_model_len // engine.block_size))
