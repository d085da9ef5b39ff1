"""The FastAPI app: OpenAI-compatible routes, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plugserve import __version__
from plugserve.frontend.engine_client import AsyncEngineClient, EngineDeadError, RequestError
from plugserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from plugserve.frontend.serving import (
    SSE_DONE,
    InvalidRequest,
    ModelNotFound,
    OpenAIServing,
    sse_event,
)
from plugserve.messages import FINISH_REASONS

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0
API_SERVER_HEADER = "x-plugserve-api-server"
T = TypeVar("T")


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status_code=status,
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(loc) or None
    return (f"{param}: {err['msg']}" if param else err["msg"]), param


def build_app(
    client: AsyncEngineClient,
    serving: OpenAIServing,
    api_key: str | None,
    server_name: str = "ApiServer",
) -> FastAPI:
    """The app of one API server, `server_name` (its process name): every response says
    which API server process answered, in x-plugserve-api-server ("ApiServer_1 pid=42"),
    since several may share the port."""
    identity = f"{server_name} pid={os.getpid()}"

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.shutdown()

    app = FastAPI(title="plugserve", version=__version__, lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    app.add_middleware(_AuthAndIdentify, api_key=api_key, identity=identity)

    async def run(
        request: Request, body: ChatCompletionRequest | CompletionRequest, chat: bool
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

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await run(request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await run(request, body, chat=False)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
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

    @app.get("/health")
    async def health() -> Response:
        try:
            await client.check_health(HEALTH_TIMEOUT_S)
        except EngineDeadError as exc:
            return error_response(503, str(exc), "server_error")
        except TimeoutError:
            return error_response(
                503, f"the engine did not answer within {HEALTH_TIMEOUT_S:.0f} s", "server_error"
            )
        return Response(status_code=200)

    @app.get("/bench/weight_read")
    async def weight_read(seconds: float = 1.0, engine: int = 0) -> Response:
        """The bandwidth floor of a batch-1 step, measured on the engine's own weights:
        it reads them for `seconds` between two steps (running requests wait)."""
        if not 0 < seconds <= 10:
            return error_response(400, "seconds must be in (0, 10]", "invalid_request_error")
        try:
            read = await client.measure_weight_read(seconds, seconds + HEALTH_TIMEOUT_S, engine)
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        except EngineDeadError as exc:
            return error_response(503, str(exc), "server_error")
        except TimeoutError:
            return error_response(503, "the engine did not answer in time", "server_error")
        if read.error is not None:
            return error_response(409, read.error, "invalid_request_error")
        return JSONResponse(
            {
                "engine": read.engine_index,
                "weight_bytes": read.weight_bytes,
                "read_bandwidth_gb_s": round(read.bytes_per_second / 1e9, 2),
                "floor_ms": round(read.weight_bytes / read.bytes_per_second * 1e3, 3),
            }
        )

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        # The ping's answer carries fresh scheduler stats from the busy loop.
        try:
            await client.check_health(HEALTH_TIMEOUT_S)
        except (EngineDeadError, TimeoutError) as exc:
            return error_response(503, str(exc) or "engine not answering", "server_error")
        s = client.stats
        lines = [
            ("plugserve_num_requests_running", "gauge", s.num_running),
            ("plugserve_num_requests_waiting", "gauge", s.num_waiting),
            ("plugserve_kv_cache_usage", "gauge", s.kv_usage),
            ("plugserve_kv_cache_blocks", "gauge", s.num_kv_blocks),
            ("plugserve_kv_cache_free_blocks", "gauge", s.num_free_kv_blocks),
            ("plugserve_prefix_cache_queries_total", "counter", s.prefix_cache_queries),
            ("plugserve_prefix_cache_hits_total", "counter", s.prefix_cache_hits),
            ("plugserve_preemptions_total", "counter", s.num_preemptions),
            ("plugserve_engine_steps_total", "counter", s.num_steps),
            ("plugserve_engine_step_seconds_total", "counter", s.step_seconds),
            ("plugserve_engine_forward_seconds_total", "counter", s.forward_seconds),
            ("plugserve_engine_generated_tokens_total", "counter", s.num_generated_tokens),
        ]
        text = "".join(f"# TYPE {name} {kind}\n{name} {value}\n" for name, kind, value in lines)
        name = "plugserve_engine_requests_finished_total"
        text += f"# TYPE {name} counter\n" + "".join(
            f'{name}{{reason="{reason}"}} {s.num_finished.get(reason, 0)}\n'
            for reason in FINISH_REASONS
        )
        name = "plugserve_engine_requests_total"
        text += f"# TYPE {name} counter\n" + "".join(
            f'{name}{{engine="{i}"}} {n}\n' for i, n in enumerate(client.requests_per_engine)
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


class _AuthAndIdentify:
    """Checks the API key on /v1/ routes and names the answering API server in every
    response. A plain ASGI middleware: starlette's BaseHTTPMiddleware would relay every
    streamed chunk through an extra task and queue."""

    def __init__(self, app: Any, *, api_key: str | None, identity: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.header = (API_SERVER_HEADER.encode(), identity.encode())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_identified(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        if self.expected is not None and scope["path"].startswith("/v1/"):
            authorization = dict(scope["headers"]).get(b"authorization")
            if authorization != self.expected:
                response = error_response(401, "invalid or missing API key", "authentication_error")
                await response(scope, receive, send_identified)
                return
        await self.app(scope, receive, send_identified)


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
