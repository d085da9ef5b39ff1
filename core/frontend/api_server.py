"""The FastAPI app of one API server: the routers (routes/: OpenAI, health, metrics,
bench) assembled with OpenAI's error shape for every error, the API key check, and the
lifespan that shuts the engine client down."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plugserve import __version__
from plugserve.frontend.engine_client import AsyncEngineClient
from plugserve.frontend.routes import bench, health, metrics, openai

# error_response and HEALTH_TIMEOUT_S moved to routes/shared.py; still importable from
# here for one release.
from plugserve.frontend.routes.shared import HEALTH_TIMEOUT_S, error_response
from plugserve.frontend.serving import OpenAIServing

logger = logging.getLogger(__name__)

API_SERVER_HEADER = "x-plugserve-api-server"

__all__ = ["API_SERVER_HEADER", "HEALTH_TIMEOUT_S", "build_app", "error_response"]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        # Every unknown field at once, by its path: no field is silently ignored.
        names = [".".join(str(p) for p in e["loc"] if p != "body") for e in unknown]
        return (
            f"unsupported field{'s' if len(names) > 1 else ''}: {', '.join(names)} "
            "(not implemented by this server; see docs/api.md)",
            names[0],
        )
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
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await app.state.engine_client.shutdown()

    app = FastAPI(title="plugserve", version=__version__, lifespan=lifespan)
    # What the routers take through their dependencies (routes/shared.py).
    app.state.engine_client = client
    app.state.openai_serving = serving
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(_AuthAndIdentify, api_key=api_key, identity=identity)
    for router in (openai.router, health.router, bench.router, metrics.router):
        app.include_router(router)
    return app


async def _invalid_request(_req: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc)
    return error_response(400, message, "invalid_request_error", param)


async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error")


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
