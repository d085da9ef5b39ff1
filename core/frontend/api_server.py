"""The FastAPI app of one API server: the endpoints every plugin registers, the bundled
ones first (route_registration.py, routes/), with OpenAI's error shape for every error,
the gate every request passes (middleware.py: API key, request id, draining), CORS when
origins are allowed, and the lifespan that shuts the engine client down."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plugserve import __version__
from plugserve.config import StackConfig
from plugserve.frontend.admission import Admission
from plugserve.frontend.engine_client import AsyncEngineClient
from plugserve.frontend.middleware import (
    API_SERVER_HEADER,
    REQUEST_ID_HEADER,
    ServerGate,
    Traffic,
)
from plugserve.frontend.route_registration import ENGINE_ERROR_HANDLERS, register_routes
from plugserve.frontend.routes.endpoint_flow import (
    ERROR_RESPONSES,
    error_response,
    internal_error_response,
    validation_message,
)
from plugserve.frontend.serving import OpenAIServing
from plugserve.plugins import PluginRegistry

logger = logging.getLogger(__name__)

__all__ = ["build_app"]


def build_app(
    client: AsyncEngineClient,
    serving: OpenAIServing,
    api_key: str | None,
    server_name: str = "ApiServer",
    *,
    config: StackConfig,
    registry: PluginRegistry,
    allowed_origins: list[str] | None = None,
    admission: Admission | None = None,
) -> FastAPI:
    """The app of one API server, `server_name` (its process name): every response says
    which API server process answered, in x-plugserve-api-server ("ApiServer_1 pid=42"),
    since several may share the port. Its endpoints are those `registry`'s plugins
    register, given `config`. `allowed_origins`: CORS (none: no CORS headers);
    `admission`: the bound on queued requests (none: unbounded). `app.state.traffic`
    counts the requests in flight and turns new ones away while shutdown drains them."""
    identity = f"{server_name} pid={os.getpid()}"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await app.state.engine_client.shutdown()

    app = FastAPI(
        title="plugserve", version=__version__, lifespan=lifespan, responses=ERROR_RESPONSES
    )
    # What the routers take through their dependencies (routes/endpoint_flow.py).
    app.state.engine_client = client
    app.state.openai_serving = serving
    app.state.admission = admission or Admission(None, max_num_seqs=1)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for exc_type, handler in ENGINE_ERROR_HANDLERS.items():
        app.add_exception_handler(exc_type, handler)
    # The gate answers a route's exception; this answers one raised outside it (in CORS),
    # which starlette would otherwise answer with a plain-text page.
    app.add_exception_handler(Exception, _server_error)
    app.state.traffic = Traffic()
    app.add_middleware(ServerGate, api_key=api_key, identity=identity, traffic=app.state.traffic)
    if allowed_origins:
        # Outermost: a preflight is answered before the API key is asked for.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=[REQUEST_ID_HEADER, API_SERVER_HEADER],
        )
    register_routes(
        app,
        registry,
        config=config,
        client=client,
        renderer=serving.renderer,
        model_name=serving.model_name,
        admission=app.state.admission,
    )
    return app


async def _invalid_request(_req: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(exc)
    return error_response(400, message, "invalid_request_error", param)


async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error")


async def _server_error(_req: Request, exc: Exception) -> JSONResponse:
    return internal_error_response(exc)
