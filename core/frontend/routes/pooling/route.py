"""POST /pooling (vLLM's): the raw pooled output of each input, for any task the model
serves (token_embed: one vector per prompt token)."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.pooling_serving import PooledPrompts, PoolingServing, usage
from plugserve.frontend.protocol import StrictModel
from plugserve.frontend.routes.embeddings.route import embedding_data
from plugserve.frontend.routes.endpoint_flow import EngineClientDep, ServingDep, answer
from plugserve.pooling_params import PoolingParams, PoolingTask

router = APIRouter()


class PoolingRequest(StrictModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    # None: the model's first task (embed for an embedder, classify for a classifier).
    task: PoolingTask | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)


@router.post("/pooling")
async def pooling(
    body: PoolingRequest, request: Request, serving: ServingDep, client: EngineClientDep
) -> Response:
    pooler = PoolingServing(serving)
    task = body.task or (pooler.setup.tasks[0] if pooler.setup.tasks else "embed")

    def prepare() -> PooledPrompts:
        pooler.check(body.model, task, "/pooling")
        pooler.check_dimensions(body.dimensions)
        try:
            params = PoolingParams(
                task=task,
                dimensions=body.dimensions,
                normalize=body.normalize,
                truncate_prompt_tokens=body.truncate_prompt_tokens,
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc), "dimensions") from exc
        return pooler.prepare(pooler.prompts(body.input), params)

    async def complete(prepared: PooledPrompts) -> dict[str, Any]:
        outputs = await pooler.run(prepared)
        return {
            "id": f"pool-{uuid.uuid4().hex}",
            "object": "list",
            "model": serving.model_name,
            "data": [
                {"object": "pooling", "index": i, "data": embedding_data(o, body.encoding_format)}
                for i, o in enumerate(outputs)
            ],
            "usage": usage(prepared),
        }

    return await answer(request, client, prepare, stream=False, events=None, complete=complete)
