"""The OpenAI-compatible routes: chat completions, completions, the model list."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from plugserve.frontend.engine_client import AsyncEngineClient, EngineDeadError, RequestError
from plugserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from plugserve.frontend.routes.shared import EngineClient, Serving, error_response
from plugserve.frontend.serving import (
    SSE_DONE,
    InvalidRequest,
    ModelNotFound,
    OpenAIServing,
    sse_event,
)

router = APIRouter()
T = TypeVar("T")


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, client: EngineClient, serving: Serving
) -> Response:
    return await _generate(request, body, client, serving, chat=True)


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, request: Request, client: EngineClient, serving: Serving
) -> Response:
    return await _generate(request, body, client, serving, chat=False)


@router.get("/v1/models")
async def models(serving: Serving) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": serving.model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "plugserve",
                "max_model_len": serving.max_model_len,
            }
        ],
    }


async def _generate(
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    client: AsyncEngineClient,
    serving: OpenAIServing,
    chat: bool,
) -> Response:
    try:
        prep = serving.prepare_chat(body) if chat else serving.prepare_completion(body)
    except ModelNotFound as exc:
        return error_response(404, str(exc), "invalid_request_error", "model")
    except InvalidRequest as exc:
        return error_response(400, str(exc), "invalid_request_error", exc.param)
    if client.is_dead:
        return error_response(503, client.dead_reason or "engine is dead", "server_error")
    if body.stream:
        return StreamingResponse(
            _guard_stream(serving.stream(prep, chat, body.include_usage)),
            media_type="text/event-stream",
        )
    try:
        result = await _until_disconnected(request, serving.complete(prep, chat))
    except EngineDeadError as exc:
        return error_response(503, str(exc), "server_error")
    except RequestError as exc:
        return error_response(500, str(exc), "server_error")
    if result is None:  # the client left; its request was aborted
        return Response(status_code=499)
    return JSONResponse(result)


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work` unless the client disconnects first; then cancel it (which aborts its
    engine requests) and return None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _guard_stream(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Errors after the response started can only travel as an SSE error event."""
    try:
        async for event in events:
            yield event
    except (EngineDeadError, RequestError) as exc:
        # The same code a non-streamed request would have got: 503 for a dead engine.
        code = 503 if isinstance(exc, EngineDeadError) else 500
        payload = {
            "error": {"message": str(exc), "type": "server_error", "param": None, "code": code}
        }
        yield sse_event(payload)
        yield SSE_DONE
