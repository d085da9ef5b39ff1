"""How endpoints join an API server's app through `register_routes`: a plugin's routes
are served as the bundled ones are (behind the same gate, errors in OpenAI's shape,
their engine requests under the same admission bound), and a method and path two
plugins claim fails naming both. On the real app, registry, renderer and admission; the
engines are a scripted stand-in."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import APIRouter
from starlette.testclient import TestClient

from plugserve import SamplingParams, hookimpl
from plugserve.config import StackConfig
from plugserve.datatypes import RequestDelta
from plugserve.frontend.admission import Admission
from plugserve.frontend.api_server import build_app
from plugserve.frontend.request_state import EngineDeadError, RequestError
from plugserve.frontend.serving import OpenAIServing
from plugserve.interfaces.frontend import ApiServer
from plugserve.plugins import PluginError, PluginRegistry
from plugserve_plugins.text.hf_renderer import HFRenderer

KEY = {"authorization": "Bearer k"}


class ScriptedEngines:
    """The engine client's surface the app uses: each request answers `text`, or raises
    `failure` once its iteration starts."""

    def __init__(self, text: str = "Paris", failure: Exception | None = None) -> None:
        self.ready = SimpleNamespace(max_model_len=64)
        self.is_dead, self.dead_reason = False, None
        self.text, self.failure = text, failure

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, *, priority: int = 0
    ) -> AsyncIterator[RequestDelta]:
        if self.failure is not None:
            raise self.failure
        yield RequestDelta(self.text, [1], None, "stop", None, len(prompt), 1, 0)

    async def shutdown(self) -> None:
        pass


class EchoPlugin:
    """A third party's endpoint: what the engines say after the prompt, and which model."""

    @hookimpl
    def register_routes(self, server: ApiServer) -> None:
        router = APIRouter()

        @router.post("/v1/echo")
        async def echo(prompt: str) -> dict[str, Any]:
            ids = server.renderer.encode(prompt)
            deltas = server.engine_client.generate("echo", ids, SamplingParams(max_tokens=1))
            text = "".join([delta.text async for delta in deltas])
            return {"model": server.model_name, "text": text, "room": server.max_model_len}

        server.include_router(router)


class ClaimsCompletions:
    @hookimpl
    def register_routes(self, server: ApiServer) -> None:
        router = APIRouter()
        router.add_api_route("/v1/completions", lambda: {}, methods=["POST"])
        server.include_router(router)


@pytest.fixture(scope="module")
def renderer(smollm2_path: Path) -> HFRenderer:
    return HFRenderer(model_path=str(smollm2_path))


def app_with(
    renderer: HFRenderer,
    plugins: dict[str, object],
    engines: ScriptedEngines | None = None,
    admission: Admission | None = None,
) -> Any:
    registry = PluginRegistry()
    for name, plugin in plugins.items():
        registry.register(plugin, name, distribution=f"acme-{name}")
    client: Any = engines or ScriptedEngines()
    return build_app(
        client,
        OpenAIServing(client, renderer, "m"),
        "k",
        config=StackConfig(),
        registry=registry,
        admission=admission,
    )


def test_a_plugins_route_is_served_behind_the_gate_every_route_passes(renderer):
    http = TestClient(app_with(renderer, {"echo": EchoPlugin()}))
    refused = http.post("/v1/echo", params={"prompt": "Hi"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    answered = http.post("/v1/echo", params={"prompt": "Hi"}, headers=KEY)
    assert answered.json() == {"model": "m", "text": "Paris", "room": 64}
    assert answered.headers["x-request-id"] and answered.headers["x-plugserve-api-server"]
    assert http.post("/v1/completions", headers=KEY, json={}).status_code == 400  # bundled


def test_a_method_and_path_already_served_is_refused_naming_both(renderer):
    with pytest.raises(PluginError) as bundled:
        app_with(renderer, {"claims": ClaimsCompletions()})
    assert str(bundled.value) == (
        "POST /v1/completions is served by plugin 'plugserve.routes' (distribution "
        "'plugserve') and by plugin 'claims' (distribution 'acme-claims')"
    )
    with pytest.raises(PluginError, match=r"'echo' .* and by plugin 'echo-again'"):
        app_with(renderer, {"echo": EchoPlugin(), "echo-again": EchoPlugin()})


def test_a_plugins_engine_requests_count_against_the_admission_bound(renderer):
    admission = Admission(0, max_num_seqs=1)  # one engine request at a time
    http = TestClient(app_with(renderer, {"echo": EchoPlugin()}, admission=admission))
    in_flight = admission.acquire(1)  # a bundled endpoint's request, say
    refused = http.post("/v1/echo", params={"prompt": "Hi"}, headers=KEY)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    in_flight.release()
    assert http.post("/v1/echo", params={"prompt": "Hi"}, headers=KEY).status_code == 200
    assert admission.in_flight == 0


@pytest.mark.parametrize(
    ("failure", "status", "kind"),
    [
        (EngineDeadError("engine 0 died"), 503, "server_error"),
        (RequestError("bad token", in_request=True), 400, "invalid_request_error"),
        (RequestError("kernel failed"), 500, "server_error"),
    ],
)
def test_what_the_engine_client_raises_is_answered_in_openais_shape(
    renderer, failure, status, kind
):
    engines = ScriptedEngines(failure=failure)
    http = TestClient(
        app_with(renderer, {"echo": EchoPlugin()}, engines), raise_server_exceptions=False
    )
    answer = http.post("/v1/echo", params={"prompt": "Hi"}, headers=KEY)
    assert answer.status_code == status
    assert answer.json()["error"] == {
        "message": str(failure),
        "type": kind,
        "param": None,
        "code": status,
    }
