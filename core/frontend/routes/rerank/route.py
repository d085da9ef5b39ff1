"""POST /rerank, /v1/rerank, /v2/rerank in the Jina and Cohere shape: the documents
ordered by their relevance to the query, the best `top_n`, each with its index in the
request and, with `return_documents`, its text."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.pooling_serving import PoolingServing
from plugserve.frontend.protocol import StrictModel
from plugserve.frontend.routes.endpoint_flow import EngineClientDep, ServingDep, answer
from plugserve.frontend.routes.score.serving import ScoredPairs, prepare_pairs, score_pairs

router = APIRouter()


class RerankDocument(BaseModel):
    """Cohere's document object: its text (other fields are the client's own)."""

    model_config = ConfigDict(extra="allow")
    text: str


class RerankRequest(StrictModel):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    # None or 0: every document.
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)


def _text(document: str | RerankDocument) -> str:
    return document if isinstance(document, str) else document.text


async def _rerank(
    body: RerankRequest, request: Request, serving: ServingDep, client: EngineClientDep
) -> Response:
    pooler = PoolingServing(serving)
    texts = [_text(d) for d in body.documents]

    def prepare() -> ScoredPairs:
        pooler.check(body.model, "score", request.url.path)
        if not texts:
            raise InvalidRequest("documents is empty: give at least one to rank", "documents")
        if not body.query:
            raise InvalidRequest("query is empty", "query")
        return prepare_pairs(
            pooler, [body.query] * len(texts), texts, body.truncate_prompt_tokens, "documents"
        )

    async def complete(pairs: ScoredPairs) -> dict[str, Any]:
        scores = await score_pairs(pooler, pairs)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": serving.model_name,
            "usage": {"total_tokens": pairs.prepared.num_tokens},
            "results": results,
        }

    return await answer(request, client, prepare, stream=False, events=None, complete=complete)


for _path in ("/rerank", "/v1/rerank", "/v2/rerank"):
    router.add_api_route(_path, _rerank, methods=["POST"])
