"""The pooling runner's half of a step: what execute_model returns for a pooling model
instead of parking logits.

Requests reach their last prompt chunk at different steps (chunked prefill). For each
request, the rows its pooler reads (interfaces.pooling.Pooler.tokens: the first, the last
or every prompt token's final hidden state) are kept across its chunks; in the step its
prompt completes, the pooler turns them into one output, and the core finishes it: the
classification head and its activation (softmax, or sigmoid for one label, as
sentence-transformers' CrossEncoder), or for an embedding the Matryoshka truncation to
`dimensions` and the L2 normalisation (after truncating, so the vector is unit length).
Outputs leave as float32 PooledTensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from plugserve.capabilities import has_classifier, takes_token_type_ids
from plugserve.config import StackConfig
from plugserve.datatypes import NewRequestData, PooledTensor, SchedulerOutput
from plugserve.interfaces.pooling import Pooler
from plugserve.plugins import PluginRegistry
from plugserve.pooling_params import PoolingParams
from plugserve.pooling_setup import PoolingSetup
from plugserve.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)
_DEFAULT_PARAMS = PoolingParams()


class PooledOutputs:
    def __init__(self, model: torch.nn.Module, pooler: Pooler, setup: PoolingSetup) -> None:
        self.model = model
        self.pooler = pooler
        self.setup = setup
        self.classifier = model if has_classifier(model) else None
        self._params: dict[str, PoolingParams] = {}
        # Hidden rows kept from a request's earlier prompt chunks (what its pooler reads).
        self._kept: dict[str, list[torch.Tensor]] = {}

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        setup: PoolingSetup,
        config: StackConfig,
        registry: PluginRegistry,
    ) -> PooledOutputs:
        """With the pooler `setup` names, built from the registry with its options."""
        pooler = registry.build("pooler", setup.pooler, config.plugin_options(setup.pooler))
        logger.info("pooling model: %s pooler, normalize %s", setup.pooler, setup.normalize)
        return cls(model, pooler, setup)

    def forward(
        self, batch: InputBatch, so: SchedulerOutput, ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The model's forward pass, given the step's segment ids where it takes them."""
        if takes_token_type_ids(self.model):
            segments = self.token_type_ids(batch, so, ids.device)
            if segments is not None:
                return self.model(ids, positions, token_type_ids=segments)
        return self.model(ids, positions)

    def add(self, new_reqs: Iterable[NewRequestData]) -> None:
        for new in new_reqs:
            self._params[new.req_id] = new.pooling_params or _DEFAULT_PARAMS
            self._kept.pop(new.req_id, None)  # a preempted request starts over

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._params.pop(req_id, None)
            self._kept.pop(req_id, None)

    def token_type_ids(
        self, batch: InputBatch, so: SchedulerOutput, device: torch.device
    ) -> torch.Tensor | None:
        """The step's flat segment ids, where a request in it has any; else None."""
        rows = np.sort([batch.req_id_to_row[r] for r in so.num_scheduled_tokens])
        segments = [self._params[batch.req_ids[row]].token_type_ids for row in rows.tolist()]
        if not any(segments):
            return None
        parts = []
        for row, segment in zip(rows.tolist(), segments, strict=True):
            start = int(batch.num_computed_tokens[row])
            count = so.num_scheduled_tokens[batch.req_ids[row]]
            if segment:
                parts.append(np.asarray(segment[start : start + count], dtype=np.int64))
            else:
                parts.append(np.zeros(count, dtype=np.int64))
        return torch.from_numpy(np.concatenate(parts)).to(device)

    def pool(
        self, batch: InputBatch, so: SchedulerOutput, query_start: np.ndarray, hidden: torch.Tensor
    ) -> dict[str, PooledTensor]:
        """The pooled outputs of the requests whose prompt completes in this step."""
        # The step's rows in the order of its tokens (StepInputBuilder's order: by row).
        rows = np.sort([batch.req_id_to_row[r] for r in so.num_scheduled_tokens])
        finished: list[tuple[str, torch.Tensor]] = []
        reads = self.pooler.tokens
        for k, row in enumerate(rows.tolist()):
            req_id = batch.req_ids[row]
            params = self._params[req_id]
            start = int(batch.num_computed_tokens[row])
            first, last = int(query_start[k]), int(query_start[k + 1])
            done = start + (last - first) >= int(batch.num_prompt_tokens[row])
            every_token = reads == "all" or params.task == "token_embed"
            if every_token:
                chunk = hidden[first:last]
            elif reads == "first":
                chunk = hidden[first : first + 1] if start == 0 else hidden[first:first]
            else:
                chunk = hidden[last - 1 : last]
            if not done:
                if chunk.shape[0] and (every_token or reads == "first"):
                    self._kept.setdefault(req_id, []).append(chunk.clone())
                continue
            kept = self._kept.pop(req_id, [])
            rows_read = torch.cat([*kept, chunk]) if kept else chunk
            if params.task == "token_embed":
                finished.append((req_id, rows_read))
            else:
                finished.append((req_id, self.pooler.pool(rows_read)))
        return self._finish(finished)

    def _finish(self, finished: list[tuple[str, torch.Tensor]]) -> dict[str, PooledTensor]:
        if not finished:
            return {}
        out: dict[str, PooledTensor] = {}
        heads = [
            (req_id, x)
            for req_id, x in finished
            if self._params[req_id].task in ("classify", "score")
        ]
        if heads:
            if self.classifier is None:
                raise ValueError("this model has no classification head")
            pooled = torch.stack([x for _, x in heads]).to(_dtype_of(self.model))
            logits = self.classifier.classify(pooled)
            for (req_id, _), row in zip(heads, logits, strict=True):
                out[req_id] = self._activate(row, self._params[req_id])
        for req_id, x in finished:
            params = self._params[req_id]
            if params.task in ("classify", "score"):
                continue
            vector = x.float()
            if params.dimensions is not None:
                vector = vector[..., : params.dimensions]
            normalize = self.setup.normalize if params.normalize is None else params.normalize
            if normalize:
                vector = F.normalize(vector, p=2.0, dim=-1)
            out[req_id] = PooledTensor.from_array(vector.cpu().numpy())
        return out

    @staticmethod
    def _activate(logits: torch.Tensor, params: PoolingParams) -> PooledTensor:
        if params.activation:
            logits = logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(dim=-1)
        return PooledTensor.from_array(logits.cpu().numpy())


def _dtype_of(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype
