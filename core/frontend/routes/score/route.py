"""POST /score (vLLM's): the relevance of text_2 to text_1, per pair: one text_1 against
each text_2, or the two lists pairwise."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.pooling_serving import PoolingServing
from plugserve.frontend.protocol import StrictModel
from plugserve.frontend.routes.endpoint_flow import EngineClientDep, ServingDep, answer
from plugserve.frontend.routes.score.serving import ScoredPairs, prepare_pairs, score_pairs

router = APIRouter()


class ScoreRequest(StrictModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=1)


@router.post("/score")
async def score(
    body: ScoreRequest, request: Request, serving: ServingDep, client: EngineClientDep
) -> Response:
    pooler = PoolingServing(serving)

    def prepare() -> ScoredPairs:
        pooler.check(body.model, "score", "/score")
        first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if not first or not second:
            raise InvalidRequest("text_1 and text_2 must each hold a text", "text_2")
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise InvalidRequest(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, "
                "or as many as text_2",
                "text_2",
            )
        return prepare_pairs(pooler, first, second, body.truncate_prompt_tokens, "text_2")

    async def complete(pairs: ScoredPairs) -> dict[str, Any]:
        scores = await score_pairs(pooler, pairs)
        tokens = pairs.prepared.num_tokens
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "model": serving.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    return await answer(request, client, prepare, stream=False, events=None, complete=complete)
