"""Driving a model's forward pass the way the model runner does, for unit tests of models
and of what runs their layers (tests/unit/worker, tests/unit/cpu_bf16): a paged attention
backend, a runner that owns each request's blocks, and a bf16 model built as an engine
builds it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from correctness.tiny_checkpoints import tiny

from plugserve.interfaces.model import AttentionBatch, AttentionSpec
from plugserve.worker.linear_methods import LinearMethodChooser, give_linear_methods
from plugserve.worker.model_passes import NamedPass, build_model_passes
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention

BLOCK_SIZE = 16
# tiny()'s layers with a vocabulary of 128 (these models need no tokenizer) and an MLP 96
# wide.
SIZES = tiny(vocab_size=128, intermediate_size=96, max_position_embeddings=256)


class PagedRunner:
    """Drives a model through the backend the way the model runner does: each request
    owns blocks from a shuffled pool; each step is one flat batch of (request, tokens)."""

    def __init__(self, model: Any, backend: Any, num_blocks: int) -> None:
        self.model, self.backend = model, backend
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, rows: list[tuple[str, list[int]]]) -> torch.Tensor:
        """rows: (request, new token ids) → fp32 logits of each row's last token."""
        ids, positions, slots, seq_lens, tables = [], [], [], [], []
        for name, tokens in rows:
            start = self.num_computed.get(name, 0)
            end = start + len(tokens)
            blocks = self.blocks.setdefault(name, [])
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.free.pop())
            pos = np.arange(start, end)
            ids += tokens
            positions.append(pos)
            slots.append(np.asarray(blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            seq_lens.append(end)
            tables.append(blocks)
            self.num_computed[name] = end
        table = np.zeros((len(rows), max(map(len, tables))), dtype=np.int32)
        for i, blocks in enumerate(tables):
            table[i, : len(blocks)] = blocks
        query_start = np.cumsum([0] + [len(tokens) for _, tokens in rows], dtype=np.int32)
        self.backend.prepare(
            AttentionBatch(
                query_start_loc=query_start,
                seq_lens=np.asarray(seq_lens, dtype=np.int32),
                block_table=table,
                slot_mapping=np.concatenate(slots).astype(np.int64),
            )
        )
        hidden = self.model(torch.tensor(ids), torch.from_numpy(np.concatenate(positions)))
        return self.model.compute_logits(hidden[torch.from_numpy(query_start[1:] - 1).long()])


def make_backend(
    config: Any,
    num_blocks: int,
    dtype: torch.dtype = torch.float32,
    layers: Iterable[Any] = (),
) -> TorchPagedAttention:
    """The torch paged backend for `config`'s heads (`layers`: each layer's
    LayerAttention, where not all full causal), its cache allocated."""
    heads = config.num_attention_heads
    backend = TorchPagedAttention(
        spec=AttentionSpec(
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            block_size=BLOCK_SIZE,
            dtype=dtype,
            device=torch.device("cpu"),
            layers=tuple(layers),
        )
    )
    backend.allocate_kv_cache(num_blocks)
    return backend


def bf16_model(
    model_cls: type,
    config: Any,
    num_blocks: int,
    parallel: Any = None,
    linear_method: str | None = None,
) -> tuple[Any, TorchPagedAttention]:
    """A bf16 `model_cls` (random weights) over its own bf16 backend, weights as built, its
    linears given the methods an engine gives them on this CPU, or `linear_method` where
    named (processed by finish_loading)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        attention = model_cls.attention_layers(config)
        backend = make_backend(config, num_blocks, torch.bfloat16, attention)
        extra = {} if parallel is None else {"parallel": parallel}
        model = model_cls(hf_config=config, attention=backend, **extra)
        chooser = LinearMethodChooser(
            dtype=torch.bfloat16, device=torch.device("cpu"), selected=linear_method
        )
        give_linear_methods(model, chooser)
    finally:
        torch.set_default_dtype(previous)
    return model, backend


def automatic_passes() -> list[NamedPass]:
    """The model passes an engine applies when stack.model_passes is unset."""
    return build_model_passes(None)


def write_embedder_files(folder: Path, smollm2_path: Path, *, normalize: bool) -> None:
    """Beside a saved encoder checkpoint: a tokenizer (SmolLM2's: tests feed token ids)
    and sentence-transformers' files naming mean pooling (and, with `normalize`, the
    Normalize module)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(smollm2_path / name, folder / name)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True})
    )
