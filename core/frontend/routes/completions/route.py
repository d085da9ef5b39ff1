"""POST /v1/completions (serving.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from plugserve.frontend.routes.completions.protocol import CompletionRequest
from plugserve.frontend.routes.completions.serving import CompletionServing
from plugserve.frontend.routes.endpoint_flow import (
    STREAMED_RESPONSES,
    EngineClientDep,
    ServingDep,
    answer,
)

router = APIRouter()


@router.post("/v1/completions", responses=STREAMED_RESPONSES)
async def completions(
    body: CompletionRequest, request: Request, client: EngineClientDep, serving: ServingDep
) -> Response:
    completion = CompletionServing(serving)
    return await answer(
        request,
        client,
        lambda: completion.prepare(body, f"cmpl-{request.state.request_id}"),
        stream=body.stream,
        events=lambda prep: completion.stream(prep, body.include_usage),
        complete=completion.complete,
    )
