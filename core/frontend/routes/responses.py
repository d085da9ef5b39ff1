"""OpenAI's Responses API: POST /v1/responses, streamed or not (serving_responses.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from plugserve.frontend.admission import Overloaded
from plugserve.frontend.engine_client import EngineDeadError, RequestError
from plugserve.frontend.errors import InvalidRequest, ModelNotFound
from plugserve.frontend.protocol_responses import ResponsesRequest
from plugserve.frontend.routes.openai import streaming_response, until_disconnected
from plugserve.frontend.routes.shared import (
    EngineClient,
    Serving,
    error_response,
    overloaded_response,
)
from plugserve.frontend.serving_responses import ResponsesServing

router = APIRouter()


@router.post("/v1/responses")
async def create_response(
    body: ResponsesRequest, request: Request, client: EngineClient, serving: Serving
) -> Response:
    responses = ResponsesServing(serving)
    try:
        prep = responses.prepare(body, request.state.request_id)
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
    if body.stream:
        return streaming_response(responses.stream(body, prep), slot)
    try:
        result = await until_disconnected(request, responses.create(body, prep))
    except EngineDeadError as exc:
        return error_response(503, str(exc), "server_error")
    except RequestError as exc:
        return error_response(500, str(exc), "server_error")
    finally:
        slot.release()
    if result is None:  # the client left; its request was aborted
        return Response(status_code=499)
    return JSONResponse(result)
