"""POST /v1/chat/completions (serving.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from plugserve.frontend.routes.chat.protocol import ChatCompletionRequest
from plugserve.frontend.routes.chat.serving import ChatServing
from plugserve.frontend.routes.endpoint_flow import (
    STREAMED_RESPONSES,
    EngineClientDep,
    ServingDep,
    answer,
)

router = APIRouter()


@router.post("/v1/chat/completions", responses=STREAMED_RESPONSES)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, client: EngineClientDep, serving: ServingDep
) -> Response:
    chat = ChatServing(serving)
    return await answer(
        request,
        client,
        lambda: chat.prepare(body, f"chatcmpl-{request.state.request_id}"),
        stream=body.stream,
        events=lambda prep: chat.stream(prep, body.include_usage),
        complete=chat.complete,
    )
