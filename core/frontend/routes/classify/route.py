"""POST /classify (vLLM's): a classifier's label and probabilities for each input."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from plugserve.frontend.pooling_serving import PooledPrompts, PoolingServing, usage
from plugserve.frontend.protocol import StrictModel
from plugserve.frontend.routes.endpoint_flow import EngineClientDep, ServingDep, answer
from plugserve.pooling_params import PoolingParams

router = APIRouter()


class ClassificationRequest(StrictModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = Field(None, ge=1)


@router.post("/classify")
async def classify(
    body: ClassificationRequest, request: Request, serving: ServingDep, client: EngineClientDep
) -> Response:
    pooler = PoolingServing(serving)
    labels = pooler.setup.id2label

    def prepare() -> PooledPrompts:
        pooler.check(body.model, "classify", "/classify")
        params = PoolingParams(task="classify", truncate_prompt_tokens=body.truncate_prompt_tokens)
        return pooler.prepare(pooler.prompts(body.input), params)

    async def complete(prepared: PooledPrompts) -> dict[str, Any]:
        outputs = await pooler.run(prepared)
        return {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "model": serving.model_name,
            "data": [
                {
                    "index": i,
                    "label": labels[int(probs.argmax())],
                    "probs": probs.tolist(),
                    "num_classes": len(probs),
                }
                for i, probs in enumerate(outputs)
            ],
            "usage": usage(prepared),
        }

    return await answer(request, client, prepare, stream=False, events=None, complete=complete)
