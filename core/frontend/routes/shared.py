"""What the routers share: the app's engine client and serving layer as FastAPI
dependencies, OpenAI's error shape, and how long an answer from the engine may take."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from plugserve.frontend.admission import Overloaded
from plugserve.frontend.engine_client import AsyncEngineClient
from plugserve.frontend.errors import internal_error_message
from plugserve.frontend.serving import OpenAIServing

HEALTH_TIMEOUT_S = 5.0  # for the engine's answer to a ping (health, metrics) or a probe


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error shape: the body of every answer but a success."""

    error: ErrorDetail


# What the OpenAPI schema says of every route's errors (all answered by error_response:
# a request body that fails validation is a 400, not FastAPI's 422).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "default": {"model": ErrorResponse, "description": "An error, in OpenAI's shape"}
}
# A route that streams when the body asks (`stream: true`): server-sent events.
STREAMED_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The answer; with `stream: true`, server-sent events",
        "content": {"text/event-stream": {}},
    }
}


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status_code=status,
    )


def internal_error_response(exc: BaseException) -> JSONResponse:
    return error_response(500, internal_error_message(exc), "server_error")


def overloaded_response(exc: Overloaded) -> JSONResponse:
    """429 with Retry-After: the queue is full (engine.max_waiting_requests)."""
    response = error_response(429, str(exc), "rate_limit_error")
    response.headers["retry-after"] = str(exc.retry_after)
    return response


# Set on app.state by api_server.build_app. The getters are async so that FastAPI calls
# them in the event loop: a plain function would be run in its thread pool, per request.
async def _engine_client(request: Request) -> AsyncEngineClient:
    return request.app.state.engine_client


async def _openai_serving(request: Request) -> OpenAIServing:
    return request.app.state.openai_serving


EngineClient = Annotated[AsyncEngineClient, Depends(_engine_client)]
Serving = Annotated[OpenAIServing, Depends(_openai_serving)]
