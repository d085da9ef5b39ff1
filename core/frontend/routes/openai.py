"""The OpenAI-compatible routes: chat completions, completions, the model list.

A request's id is its X-Request-Id (the gate gives every request one); past
`engine.max_waiting_requests` a request is answered 429 with Retry-After before it is
queued (admission.py)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from plugserve.frontend.admission import Overloaded, Slot
from plugserve.frontend.engine_client import AsyncEngineClient, EngineDeadError, RequestError
from plugserve.frontend.errors import internal_error_message
from plugserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from plugserve.frontend.routes.shared import (
    STREAMED_RESPONSES,
    EngineClient,
    Serving,
    error_response,
    overloaded_response,
)
from plugserve.frontend.serving import (
    SSE_DONE,
    InvalidRequest,
    ModelNotFound,
    OpenAIServing,
    sse_event,
)

logger = logging.getLogger(__name__)
router = APIRouter()
T = TypeVar("T")
P = TypeVar("P")


@router.post("/v1/chat/completions", responses=STREAMED_RESPONSES)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, client: EngineClient, serving: Serving
) -> Response:
    return await _generate(request, body, client, serving, chat=True)


@router.post("/v1/completions", responses=STREAMED_RESPONSES)
async def completions(
    body: CompletionRequest, request: Request, client: EngineClient, serving: Serving
) -> Response:
    return await _generate(request, body, client, serving, chat=False)


@router.get("/v1/models")
async def models(serving: Serving) -> dict[str, Any]:
    """vLLM's model card: `root` is the model as configured, `parent` null (no
    adapters), `permission` the one entry vLLM sends."""
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {
                "id": serving.model_name,
                "object": "model",
                "created": created,
                "owned_by": "plugserve",
                "root": serving.model_root,
                "parent": None,
                "max_model_len": serving.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
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
    request_id = request.state.request_id

    def prepare() -> Any:
        if chat:
            return serving.prepare_chat(body, f"chatcmpl-{request_id}")
        return serving.prepare_completion(body, f"cmpl-{request_id}")

    return await answer(
        request,
        client,
        prepare,
        stream=body.stream,
        events=lambda prep: serving.stream(prep, chat, body.include_usage),
        complete=lambda prep: serving.complete(prep, chat),
    )


async def answer(
    request: Request,
    client: AsyncEngineClient,
    prepare: Callable[[], P],
    *,
    stream: bool,
    events: Callable[[P], AsyncIterator[bytes]],
    complete: Callable[[P], Awaitable[dict[str, Any]]],
) -> Response:
    """What every generating endpoint does with a request once its body is valid: prepare
    it (404 for another model, 400 for a bad request), refuse it while the engine is dead
    (503) or the queue is full (429), then stream its events or answer once, holding an
    admission slot until the last byte; a client that leaves gets its request aborted."""
    try:
        prep = prepare()
    except ModelNotFound as exc:
        return error_response(404, str(exc), "invalid_request_error", "model")
    except InvalidRequest as exc:
        return error_response(400, str(exc), "invalid_request_error", exc.param)
    if client.is_dead:
        return error_response(503, client.dead_reason or "engine is dead", "server_error")
    try:
        slot = request.app.state.admission.acquire(prep.num_engine_requests)
    except Overloaded as exc:
        return overloaded_response(exc)
    if stream:
        return streaming_response(events(prep), slot)
    try:
        result = await until_disconnected(request, complete(prep))
    except EngineDeadError as exc:
        return error_response(503, str(exc), "server_error")
    except RequestError as exc:
        return error_response(exc.status, str(exc), exc.error_type)
    finally:
        slot.release()
    if result is None:  # the client left; its request was aborted
        return Response(status_code=499)
    return JSONResponse(result)


def streaming_response(events: AsyncIterator[bytes], slot: Slot) -> StreamingResponse:
    """Server-sent `events`, holding the admission `slot` until they end."""
    body = _guard_stream(events, slot)
    slot.release_with(body)
    return StreamingResponse(body, media_type="text/event-stream")


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
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


async def _guard_stream(events: AsyncIterator[bytes], slot: Slot) -> AsyncIterator[bytes]:
    """Errors after the response started can only travel as an SSE error event."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        # The same message, code and type a non-streamed request would have got.
        if isinstance(exc, EngineDeadError):
            message, code, error_type = str(exc), 503, "server_error"
        elif isinstance(exc, RequestError):
            message, code, error_type = str(exc), exc.status, exc.error_type
        else:
            logger.exception("a streamed answer failed")
            message, code, error_type = internal_error_message(exc), 500, "server_error"
        payload = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
        yield sse_event(payload)
        yield SSE_DONE
    finally:
        slot.release()
