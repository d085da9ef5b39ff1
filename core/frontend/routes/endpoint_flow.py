"""What every endpoint shares, owned by none: the app's engine client and serving layer
as FastAPI dependencies, OpenAI's error shape, and the flow of a generating request from
a valid body to its last byte (`answer`: 404 or 400 from its preparation, 503 while the
engine is dead, 429 past the admission bound, then one JSON answer or server-sent events,
its engine requests aborted when the client leaves)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from plugserve.frontend.admission import Overloaded, Slot
from plugserve.frontend.engine_client import AsyncEngineClient
from plugserve.frontend.errors import InvalidRequest, ModelNotFound, internal_error_message
from plugserve.frontend.request_state import EngineDeadError, RequestError
from plugserve.frontend.serving import SSE_DONE, OpenAIServing, sse_event

logger = logging.getLogger(__name__)
T = TypeVar("T")

HEALTH_TIMEOUT_S = 5.0  # for the engine's answer to a ping (health, metrics) or a probe


# ------------------------------------------------------------------ dependencies


# Set on app.state by api_server.build_app. The getters are async so that FastAPI calls
# them in the event loop: a plain function would be run in its thread pool, per request.
async def _engine_client(request: Request) -> AsyncEngineClient:
    return request.app.state.engine_client


async def _openai_serving(request: Request) -> OpenAIServing:
    return request.app.state.openai_serving


EngineClientDep = Annotated[AsyncEngineClient, Depends(_engine_client)]
ServingDep = Annotated[OpenAIServing, Depends(_openai_serving)]


# ------------------------------------------------------------------ error shape


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


def invalid_request_response(exc: InvalidRequest) -> JSONResponse:
    """404 for a model this server does not serve, else 400 naming the field at fault."""
    if isinstance(exc, ModelNotFound):
        return error_response(404, str(exc), "invalid_request_error", "model")
    return error_response(400, str(exc), "invalid_request_error", exc.param)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A body that failed validation, as a 400 names it: (message, the field at fault)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        # Every unknown field at once, by its path: no field is silently ignored.
        names = [".".join(str(p) for p in e["loc"] if _named(p)) for e in unknown]
        return (
            f"unsupported field{'s' if len(names) > 1 else ''}: {', '.join(names)} "
            "(not implemented by this server; see docs/api.md)",
            names[0],
        )
    # A field typed as a union (the Responses API's `input`) fails in every branch: the
    # deepest failure is the one that says what is wrong.
    field = errors[0].get("loc", ())[:2]
    err = max(
        (e for e in errors if e.get("loc", ())[:2] == field), key=lambda e: len(e.get("loc", ()))
    )
    loc = [str(p) for p in err.get("loc", ()) if _named(p)]
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(loc) or None
    return (f"{param}: {err['msg']}" if param else err["msg"]), param


def _named(part: object) -> bool:
    """A part of an error's path a client wrote: not the body itself, nor the label
    pydantic gives a branch of a union ("list[tagged-union[…]]")."""
    return part != "body" and "[" not in str(part)


# ------------------------------------------------------------------ a generating request


class PreparedRequest(Protocol):
    """A request its endpoint has validated, as far as admission looks at it."""

    @property
    def num_engine_requests(self) -> int: ...


P = TypeVar("P", bound=PreparedRequest)


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
    admission slot until the last byte; a client that leaves gets its request aborted.
    `prepare` returns what `events` and `complete` take, with its `num_engine_requests`."""
    try:
        prep = prepare()
    except InvalidRequest as exc:
        return invalid_request_response(exc)
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
