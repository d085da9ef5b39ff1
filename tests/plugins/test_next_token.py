"""The out-of-tree example endpoint plugin (tests/plugins/plugserve-next-token), installed
as a third-party distribution: a real `plugserve serve` serves its POST /v1/next_token
beside the bundled endpoints, through the same engine and the same gate, with errors in
OpenAI's shape — without a line of plugserve changed."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from plugserve.bench.plugserve_server import PlugserveServer
from plugserve.bench.server_process import STARTUP_TIMEOUT_S
from tests.integration.conftest import (
    MAX_MODEL_LEN,
    MODEL,
    assert_openai_error,
    running_server,
    server_under_test,
)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlugserveServer]:
    with running_server("zmq", tmp_path_factory.mktemp("next-token")) as server:
        yield server


def next_token(server: PlugserveServer, **body: object) -> httpx.Response:
    return httpx.post(server.url("/v1/next_token"), json=body, timeout=60)


def test_the_endpoint_is_served_and_described_beside_the_bundled_ones(server: PlugserveServer):
    paths = httpx.get(server.url("/openapi.json"), timeout=10).json()["paths"]
    assert {"/v1/next_token", "/v1/completions", "/v1/chat/completions"} <= set(paths)
    request_schema = paths["/v1/next_token"]["post"]["requestBody"]
    assert request_schema["content"]["application/json"]["schema"]


def test_the_next_token_is_the_first_token_of_a_greedy_completion(server: PlugserveServer):
    answer = next_token(server, prompt=PROMPT, top_logprobs=3)
    assert answer.status_code == 200, answer.text
    token = answer.json()
    completion = httpx.post(
        server.url("/v1/completions"),
        json={
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 3,
            "return_tokens_as_token_ids": True,
        },
        timeout=60,
    ).json()
    logprobs = completion["choices"][0]["logprobs"]
    assert f"token_id:{token['token_id']}" == logprobs["tokens"][0]
    assert token["token"] == completion["choices"][0]["text"]
    assert token["logprob"] == pytest.approx(logprobs["token_logprobs"][0], abs=1e-5)
    alternatives = {f"token_id:{a['token_id']}": a["logprob"] for a in token["top_logprobs"]}
    assert alternatives == pytest.approx(logprobs["top_logprobs"][0], abs=1e-5)


def test_its_errors_take_openais_shape(server: PlugserveServer):
    too_long = next_token(server, prompt="hello " * MAX_MODEL_LEN)
    assert "context" in assert_openai_error(too_long, 400)["message"]
    unknown = assert_openai_error(next_token(server, prompt=PROMPT, model=MODEL), 400)
    assert unknown["param"] == "model"


def test_its_engine_requests_leave_the_engine_idle(server: PlugserveServer):
    for _ in range(3):
        assert next_token(server, prompt=PROMPT).status_code == 200
    idle = server.wait_idle()
    assert (idle["num_requests_running"], idle["kv_cache_usage"]) == (0, 0), idle


def test_plugserve_finds_it_as_a_third_party_distribution():
    import importlib.metadata

    [entry_point] = [
        ep for ep in importlib.metadata.entry_points(group="plugserve") if ep.name == "next_token"
    ]
    assert entry_point.dist is not None
    assert entry_point.dist.metadata["Name"] == "plugserve-next-token"
    assert Path(entry_point.load().__file__).parent.name == "plugserve_next_token"


def test_a_second_plugin_claiming_its_route_stops_the_server_naming_both(tmp_path: Path):
    """At start-up, once the engines are up: the server exits, engines and all, rather
    than serve one of the two."""
    pythonpath = os.pathsep.join(
        p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p
    )
    env = {"PLUGSERVE_PLUGIN_MODULES": "rival_next_token", "PYTHONPATH": pythonpath}
    server = server_under_test("zmq", tmp_path / "server.log", env=env).launch()
    try:
        server.popen.wait(STARTUP_TIMEOUT_S)
        ended = server.stop()
    finally:
        server.kill()
    assert ended.returncode != 0
    assert (
        "POST /v1/next_token is served by plugin 'next_token' (distribution "
        "'plugserve-next-token') and by plugin 'rival_next_token'" in server.log_text()
    )
    assert re.findall(r"engine core 0 ready \(pid (\d+)\)", server.log_text())
    assert not ended.outlived, "the engines outlived their server"
