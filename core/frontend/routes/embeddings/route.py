"""POST /v1/embeddings (OpenAI's shape): one vector per input, as floats or base64."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from plugserve.frontend.pooling_serving import PooledPrompts, PoolingServing, usage
from plugserve.frontend.routes.embeddings.protocol import EmbeddingRequest
from plugserve.frontend.routes.endpoint_flow import EngineClientDep, ServingDep, answer
from plugserve.pooling_params import PoolingParams

router = APIRouter()


def embedding_data(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.tolist()


@router.post("/v1/embeddings")
async def embeddings(
    body: EmbeddingRequest, request: Request, serving: ServingDep, client: EngineClientDep
) -> Response:
    pooling = PoolingServing(serving)

    def prepare() -> PooledPrompts:
        pooling.check(body.model, "embed", "/v1/embeddings")
        pooling.check_dimensions(body.dimensions)
        params = PoolingParams(
            task="embed",
            dimensions=body.dimensions,
            normalize=body.normalize,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
        return pooling.prepare(pooling.prompts(body.input), params)

    async def complete(prepared: PooledPrompts) -> dict[str, Any]:
        vectors = await pooling.run(prepared)
        return {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": embedding_data(v, body.encoding_format),
                }
                for i, v in enumerate(vectors)
            ],
            "model": serving.model_name,
            "usage": usage(prepared),
        }

    return await answer(request, client, prepare, stream=False, events=None, complete=complete)
