"""OpenAI's Responses API: POST /v1/responses, streamed or not (serving.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from plugserve.frontend.routes.endpoint_flow import (
    STREAMED_RESPONSES,
    EngineClientDep,
    ServingDep,
    answer,
)
from plugserve.frontend.routes.responses.protocol import ResponsesRequest
from plugserve.frontend.routes.responses.serving import ResponsesServing

router = APIRouter()


@router.post("/v1/responses", responses=STREAMED_RESPONSES)
async def create_response(
    body: ResponsesRequest, request: Request, client: EngineClientDep, serving: ServingDep
) -> Response:
    responses = ResponsesServing(serving)
    return await answer(
        request,
        client,
        lambda: responses.prepare(body, request.state.request_id),
        stream=body.stream,
        events=lambda prep: responses.stream(body, prep),
        complete=lambda prep: responses.create(body, prep),
    )
