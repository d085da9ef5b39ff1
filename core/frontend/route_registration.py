"""How endpoints join an API server's app: through the `register_routes` hook, the
bundled endpoints first (routes/__init__.py), then every plugin's. Each plugin's hook is
given its own `PluginApiServer` (the contract's ApiServer), so a method and path that two
of them claim fails naming both, instead of the first silently shadowing the second.

What a plugin's routes generate through is the engine client behind the admission bound
the bundled endpoints answer 429 past (`AdmittedEngineClient`); what it raises before a
response starts is answered in OpenAI's error shape (`ENGINE_ERROR_HANDLERS`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from plugserve.config import StackConfig
from plugserve.datatypes import RequestDelta
from plugserve.frontend.admission import Admission, Overloaded, Slot
from plugserve.frontend.engine_client import AsyncEngineClient
from plugserve.frontend.request_state import EngineDeadError, RequestError
from plugserve.frontend.routes.endpoint_flow import error_response, overloaded_response
from plugserve.interfaces.frontend import EngineClient, Renderer
from plugserve.plugins import PluginError, PluginRegistry
from plugserve.sampling_params import SamplingParams

# FastAPI's own routes (/openapi.json, /docs, /redoc) are claimed in its name.
APP_ITSELF = "FastAPI (the app itself)"
ANY_METHOD = "*"


class RouteOwners:
    """Who serves each method and path of one app."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._owners: dict[str, dict[str, str]] = {}  # path -> method -> owner
        for route in app.routes:
            self._claim(route, APP_ITSELF)

    def include(self, router: Any, owner: str) -> None:
        """Serve `router`'s routes as `owner`'s; PluginError if one is already served."""
        for route in router.routes:
            self._claim(route, owner)
        self.app.include_router(router)

    def _claim(self, route: Any, owner: str) -> None:
        # A route without methods (a websocket, a mount) takes its path for every method.
        methods = getattr(route, "methods", None) or {ANY_METHOD}
        claimed = self._owners.setdefault(route.path, {})
        for method in sorted(methods):
            other = claimed.get(method) or claimed.get(ANY_METHOD)
            if other is None and method == ANY_METHOD and claimed:
                other = next(iter(claimed.values()))
            if other is not None and other != owner:
                raise PluginError(f"{method} {route.path} is served by {other} and by {owner}")
            claimed[method] = owner


class AdmittedEngineClient:
    """The engine client a plugin's routes generate through: each request takes an
    admission slot for as long as it runs, as each engine request of a bundled endpoint
    does, so `engine.max_waiting_requests` bounds them all."""

    def __init__(self, client: AsyncEngineClient, admission: Admission) -> None:
        self._client = client
        self._admission = admission

    @property
    def is_dead(self) -> bool:
        return self._client.is_dead

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        """The slot is taken here, not at the first delta, so that a full queue raises
        Overloaded (a 429) before the route has started its response, streamed or not."""
        slot = self._admission.acquire(1)
        deltas = self._holding(slot, request_id, prompt_token_ids, params, priority)
        slot.release_with(deltas)  # never iterated, a generator never runs its finally
        return deltas

    async def _holding(
        self,
        slot: Slot,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
    ) -> AsyncIterator[RequestDelta]:
        try:
            async for delta in self._client.generate(
                request_id, prompt_token_ids, params, priority=priority
            ):
                yield delta
        finally:
            slot.release()


@dataclass
class PluginApiServer:
    """The ApiServer (plugserve.interfaces) one plugin's `register_routes` is given."""

    config: StackConfig
    model_name: str
    renderer: Renderer
    engine_client: EngineClient
    max_model_len: int
    plugin: str  # as errors name it: the plugin and its distribution
    owners: RouteOwners = field(repr=False)

    def include_router(self, router: Any) -> None:
        self.owners.include(router, self.plugin)


def register_routes(
    app: FastAPI,
    registry: PluginRegistry,
    *,
    config: StackConfig,
    client: AsyncEngineClient,
    renderer: Renderer,
    model_name: str,
    admission: Admission,
) -> None:
    """Every plugin's endpoints (the bundled ones first) on `app`."""
    owners = RouteOwners(app)
    engine_client = AdmittedEngineClient(client, admission)
    assert client.ready is not None  # the engines have started
    max_model_len = client.ready.max_model_len

    def server_for(plugin: str, distribution: str) -> PluginApiServer:
        return PluginApiServer(
            config=config,
            model_name=model_name,
            renderer=renderer,
            engine_client=engine_client,
            max_model_len=max_model_len,
            plugin=f"plugin {plugin!r} (distribution {distribution!r})",
            owners=owners,
        )

    registry.register_routes(server_for)


async def _overloaded(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Overloaded)
    return overloaded_response(exc)


async def _engine_dead(_request: Request, exc: Exception) -> JSONResponse:
    return error_response(503, str(exc), "server_error")


async def _request_failed(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestError)
    return error_response(exc.status, str(exc), exc.error_type)


# For the app's exception handlers: what a plugin's route lets escape of the engine
# client, in OpenAI's shape. The bundled endpoints answer these themselves.
ENGINE_ERROR_HANDLERS: dict[type[Exception], Callable[[Request, Exception], Awaitable[Any]]] = {
    Overloaded: _overloaded,
    EngineDeadError: _engine_dead,
    RequestError: _request_failed,
}
