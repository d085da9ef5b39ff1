"""The model runner's side of a speculative proposer that runs in the worker
(capabilities.ProposesInWorker), such as a draft model.

The runner builds the proposer on every rank and loads the model it names beside the
target, with the same dtype, device, linear methods, model passes and tensor-parallel
ranks, and an attention backend of the stack's kind with a KV cache of its own. That
cache holds as many blocks as the target's and is addressed by the same block ids and
slots, so a request's entries in it are allocated, freed and rolled back with the
target's, and the prefix cache's blocks hold both models' entries for the same tokens.

Two things keep it true. After the target's forward pass, the proposer's model runs over
the same step inputs (`catch_up`), so every token the target computes (prompt chunks,
verified drafts, a prompt recomputed after preemption) has its entry in both caches.
After sampling, `propose` hands the proposer each row that sampled: its newest token,
that token's position, and how many tokens it may guess (the slots its blocks hold: the
scheduler allocates `num_tokens` past what it schedules for the proposer's writes). The
entries the proposer writes there are scratch: rejected guesses lie at or past the
request's computed tokens, and the next step's catch-up overwrites them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from plugserve.capabilities import ProposesInWorker, proposes_in_worker
from plugserve.config import StackConfig
from plugserve.interfaces.model import AttentionBackend, AttentionBatch, AttentionSpec
from plugserve.interfaces.speculative import WorkerDraftRequests
from plugserve.model_files import check_architecture, resolve_model_path
from plugserve.plugins import PluginRegistry
from plugserve.pooling_setup import PoolingSetup
from plugserve.worker.input_batch import InputBatch
from plugserve.worker.layer_attention import attention_layers, check_layer_attention, context_limit
from plugserve.worker.linear_methods import LinearMethodChooser
from plugserve.worker.model_loader import load_model
from plugserve.worker.model_passes import model_passes_from_config
from plugserve.worker.parallel import ParallelContext

logger = logging.getLogger(__name__)


class LoadedProposerModel:
    """interfaces.speculative.ProposerModel over a loaded model and its attention backend;
    `bind` gives it the runner's persistent batch, whose block tables it reads."""

    def __init__(
        self,
        model: Any,
        attention: AttentionBackend,
        *,
        vocab_size: int,
        block_size: int,
        device: torch.device,
        parallel: ParallelContext,
    ) -> None:
        self.model = model
        self.attention = attention
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = device
        self.parallel = parallel
        self.batch: InputBatch | None = None

    def decode(
        self, req_ids: Sequence[str], token_ids: np.ndarray, positions: np.ndarray
    ) -> torch.Tensor | None:
        assert self.batch is not None
        rows = np.array([self.batch.req_id_to_row[r] for r in req_ids], dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        num_blocks = int(self.batch.num_blocks[rows].max())
        block_table = np.ascontiguousarray(self.batch.block_table[rows, :num_blocks])
        block_index, offset = np.divmod(positions, self.block_size)
        slots = block_table[np.arange(len(rows)), block_index].astype(np.int64)
        self.attention.prepare(
            AttentionBatch(
                query_start_loc=np.arange(len(rows) + 1, dtype=np.int32),
                seq_lens=(positions + 1).astype(np.int32),
                block_table=block_table,
                slot_mapping=slots * self.block_size + offset,
            )
        )
        ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(self.device)
        hidden = self.model(ids, torch.from_numpy(positions).to(self.device))
        return self.model.compute_logits(hidden)

    def share(self, token_ids: np.ndarray) -> np.ndarray:
        if self.parallel.world_size == 1:
            return token_ids
        shared = torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(self.device)
        self.parallel.broadcast(shared)
        return shared.cpu().numpy()


class WorkerProposal:
    """A worker-side proposer with its loaded model: sized with the KV pool, caught up
    after every forward pass, asked for drafts after every sampling."""

    def __init__(
        self,
        proposer: ProposesInWorker,
        model: LoadedProposerModel,
        *,
        num_tokens: int,
        max_model_len: int,
    ) -> None:
        self.proposer = proposer
        self.model = model
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len

    def kv_cache_bytes_per_block(self) -> int:
        return self.model.attention.kv_cache_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.model.attention.allocate_kv_cache(num_blocks)

    def bind(self, batch: InputBatch) -> None:
        self.model.batch = batch

    def catch_up(self, step: AttentionBatch, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the proposer model's KV entries of every token the target computed this
        step (its logits are not needed)."""
        self.model.attention.prepare(step)
        self.model.model(ids, positions)

    def propose(self, rows: np.ndarray, req_ids: list[str]) -> dict[str, list[int]]:
        """Drafts for the rows that sampled this step (their new token already appended
        to the batch), by request id; requests with none are left out."""
        batch = self.model.batch
        assert batch is not None
        positions = batch.num_tokens[rows] - 1
        room = np.minimum(
            batch.num_blocks[rows].astype(np.int64) * self.model.block_size,
            self.max_model_len,
        )
        limit = np.clip(room - positions, 0, self.num_tokens)
        if not limit.any():
            return {}
        requests = WorkerDraftRequests(
            req_ids=req_ids,
            token_ids=batch.token_ids[rows, positions],
            positions=positions,
            max_num_tokens=limit,
        )
        proposals = self.proposer.propose_in_worker(self.model, requests)
        return {
            req_id: [int(t) for t in proposal[:n]]
            for req_id, proposal, n in zip(req_ids, proposals, limit.tolist(), strict=True)
            if proposal and n
        }


def load_worker_proposal(
    config: StackConfig,
    registry: PluginRegistry,
    *,
    target_vocab_size: int,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelContext,
    block_size: int,
    is_pooling: bool,
    is_pipeline_stage: bool,
) -> WorkerProposal | None:
    """The stack's speculative proposer with its model loaded, where it proposes in the
    worker; None where speculation is off or its proposer runs in the engine core.
    ValueError naming what the proposer's model cannot do here."""
    speculative = config.stack.speculative
    if speculative is None:
        return None
    name = speculative.proposer
    if not proposes_in_worker(registry.get("spec_proposer", name)):
        return None
    if is_pooling:
        raise ValueError(f"spec proposer {name!r}: a pooling model samples nothing to draft for")
    if is_pipeline_stage:
        raise ValueError(
            f"spec proposer {name!r} runs its model whole on each rank: no pipeline stages"
        )
    proposer = registry.build(
        "spec_proposer",
        name,
        config.plugin_options(name),
        num_tokens=speculative.num_tokens,
        vocab_size=target_vocab_size,
    )
    from transformers import AutoConfig

    model_name = proposer.proposer_model()
    path = resolve_model_path(model_name)
    hf_config = AutoConfig.from_pretrained(path)
    if hf_config.vocab_size != target_vocab_size:
        raise ValueError(
            f"spec proposer {name!r}: its model {model_name} has a vocabulary of "
            f"{hf_config.vocab_size} tokens, the served model {target_vocab_size}; a draft "
            "model must share the served model's vocabulary"
        )
    architecture = check_architecture(path, registry.implementations("model"))
    model_cls = registry.get("model", architecture)
    limit = context_limit(
        model_cls, hf_config, PoolingSetup(runner="generate", architecture=architecture)
    )
    if limit < max_model_len:
        raise ValueError(
            f"spec proposer {name!r}: its model {model_name} reads at most {limit} "
            f"tokens, fewer than max_model_len ({max_model_len}); lower max_model_len"
        )
    num_heads = hf_config.num_attention_heads
    heads = parallel.head_shard(
        num_heads, getattr(hf_config, "num_key_value_heads", None) or num_heads
    )
    layers = attention_layers(model_cls, hf_config)
    attention_name = config.stack.attention
    check_layer_attention(registry.get("attention", attention_name), attention_name, layers)
    spec = AttentionSpec(
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        block_size=block_size,
        dtype=dtype,
        device=device,
        layers=layers,
    )
    attention = registry.build(
        "attention", attention_name, config.plugin_options(attention_name), spec=spec
    )
    model = load_model(
        path,
        model_cls,
        attention,
        dtype,
        device,
        parallel if parallel.world_size > 1 else None,
        linear_methods=LinearMethodChooser.from_config(config, dtype, device, registry),
        model_passes=model_passes_from_config(config, registry),
    )
    logger.info("spec proposer %s: loaded %s (%s)", name, model_name, architecture)
    loaded = LoadedProposerModel(
        model,
        attention,
        vocab_size=hf_config.vocab_size,
        block_size=block_size,
        device=device,
        parallel=parallel,
    )
    return WorkerProposal(
        proposer, loaded, num_tokens=speculative.num_tokens, max_model_len=max_model_len
    )
