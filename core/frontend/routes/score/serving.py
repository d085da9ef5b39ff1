"""Scoring (query, document) pairs, which /score and /rerank share: a cross-encoder
(a classifier with one label) runs each pair as one prompt, with its segment ids, and
its sigmoid is the score, as sentence-transformers' CrossEncoder.predict; an embedder
embeds each text and the score is the cosine of the two vectors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.pooling_serving import PooledPrompts, PoolingServing
from plugserve.pooling_params import PoolingParams


@dataclass
class ScoredPairs:
    """Prompts ready for the engine and how their outputs become one score per pair."""

    prepared: PooledPrompts
    num_pairs: int
    cross_encoder: bool

    @property
    def num_engine_requests(self) -> int:
        return self.prepared.num_engine_requests


def prepare_pairs(
    pooler: PoolingServing,
    queries: list[str],
    documents: list[str],
    truncate_prompt_tokens: int | None,
    param: str,
) -> ScoredPairs:
    """One pair per (queries[i], documents[i]); 400 for an empty text."""
    for text in (*queries, *documents):
        if not text:
            raise InvalidRequest(f"{param}: a text is empty", param)
    setup = pooler.setup
    if setup.num_labels is not None:
        if setup.num_labels != 1:
            raise InvalidRequest(
                f"scoring needs a cross-encoder with one label; this classifier has "
                f"{setup.num_labels} (use /classify)",
                "model",
            )
        prompts, params = [], []
        for query, document in zip(queries, documents, strict=True):
            ids, segments = pooler.pair(query, document, truncate_prompt_tokens)
            prompts.append(ids)
            params.append(
                PoolingParams(
                    task="score",
                    truncate_prompt_tokens=truncate_prompt_tokens,
                    token_type_ids=segments,
                )
            )
        return ScoredPairs(pooler.prepare(prompts, params, param), len(prompts), True)
    texts = [*queries, *documents]
    params = PoolingParams(
        task="embed", normalize=True, truncate_prompt_tokens=truncate_prompt_tokens
    )
    prompts = [pooler.prompts(text, param)[0] for text in texts]
    return ScoredPairs(pooler.prepare(prompts, params, param), len(queries), False)


async def score_pairs(pooler: PoolingServing, pairs: ScoredPairs) -> list[float]:
    outputs = await pooler.run(pairs.prepared)
    if pairs.cross_encoder:
        return [float(o[0]) for o in outputs]
    n = pairs.num_pairs
    return [float(np.dot(outputs[i], outputs[n + i])) for i in range(n)]
