"""`plugserve serve` as a process: refusing a bad config, its process titles and logs,
its plain endpoints."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from plugserve import __version__
from plugserve.bench.plugserve_server import (
    API_SERVER_TITLE,
    ENGINE_TITLE,
    PlugserveServer,
    plugserve_command,
)
from plugserve.bench.processes import process_cmdline
from plugserve.bench.server_process import free_port
from plugserve.frontend.middleware import API_SERVER_HEADER
from tests.kernel_support import pinned_plan

from .conftest import (
    MODEL,
    REPO_ROOT,
    SERVER_SETTINGS,
    assert_openai_error,
    running_server,
)

# Transport-agnostic: the shared zmq server serves every test here once.


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (["--stack.scheduler", "nope"], "unknown scheduler 'nope'; available: "),
        (["--stack.transport", "carrier-pigeon"], "unknown transport 'carrier-pigeon'"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--no-such-setting", "1"], "unknown setting 'no_such_setting'"),
    ],
    ids=["unknown-scheduler", "unknown-transport", "invalid-value", "unknown-setting"],
)
def test_a_bad_config_fails_with_one_line_and_a_nonzero_exit(settings: list[str], says: str):
    command = [*plugserve_command(), "serve", "--port", str(free_port()), *settings]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("plugserve: error: ")
    assert says in lines[0]


def test_process_titles_and_log_lines_name_their_process(server: PlugserveServer):
    engine = server.engine_pid()
    assert process_cmdline(server.pid).startswith(API_SERVER_TITLE)
    assert process_cmdline(engine).startswith(ENGINE_TITLE)
    log = server.log_text()
    assert re.search(rf"^\S+ ApiServer pid={server.pid} INFO ", log, re.MULTILINE), log
    assert re.search(rf"^\S+ EngineCore pid={engine} INFO ", log, re.MULTILINE), log
    # Every log line that plugserve formats carries its process and pid.
    for line in log.splitlines():
        if re.match(r"^\d\d:\d\d:\d\d ", line):
            assert re.match(r"^\S+ (ApiServer|EngineCore\S*) pid=\d+ [A-Z]+ ", line), line


def test_the_api_server_runs_on_uvloop_and_parses_http_with_httptools(server: PlugserveServer):
    """Both are dependencies on Linux: they lower the API server's CPU per streamed token,
    which at c=1 is taken from the engine's cores. The server logs the loop it finds
    running and uvicorn's protocol class."""
    line = re.search(r"event loop (\S+), HTTP (\S+)", server.log_text())
    assert line is not None, server.log_tail()
    assert line.group(1).startswith("uvloop.")
    assert line.group(2) == "HttpToolsProtocol"


def test_health_version_and_metrics(server: PlugserveServer):
    with httpx.Client(timeout=30) as http:
        assert http.get(server.url("/health")).status_code == 200
        assert http.get(server.url("/version")).json() == {"version": __version__}
        metrics = http.get(server.url("/metrics"))
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "# TYPE plugserve_num_requests_running gauge" in metrics.text
    values = server.metrics()
    assert values["kv_cache_blocks"] > 0
    assert values["kv_cache_free_blocks"] <= values["kv_cache_blocks"]


def test_metrics_count_engine_steps_and_the_time_in_the_forward_pass(server: PlugserveServer):
    before = server.metrics()
    response = httpx.post(
        server.url("/v1/completions"),
        json={"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 5},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    after = server.wait_idle()
    steps = after["engine_steps_total"] - before["engine_steps_total"]
    step_s = after["engine_step_seconds_total"] - before["engine_step_seconds_total"]
    forward_s = after["engine_forward_seconds_total"] - before["engine_forward_seconds_total"]
    assert steps >= 5  # a prefill that samples the first token, then one step per token
    assert 0 < forward_s <= step_s


GUARDED_BF16_SETTINGS = (*SERVER_SETTINGS, "--dtype", "bfloat16", "--api-key", "s3cret")


@pytest.fixture(scope="module")
def guarded_bf16_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlugserveServer]:
    """One server for the two tests that need settings of their own: an API key (which
    guards /v1/ only) and bf16 weights (which the weight-read bench reads)."""
    with running_server(
        "zmq", tmp_path_factory.mktemp("guarded-bf16"), settings=GUARDED_BF16_SETTINGS
    ) as s:
        yield s


@pytest.mark.starts_server(transport="zmq", settings=GUARDED_BF16_SETTINGS)
def test_an_api_key_guards_the_v1_routes_only(guarded_bf16_server: PlugserveServer):
    server = guarded_bf16_server
    with httpx.Client(timeout=30) as http:
        refused = http.get(server.url("/v1/models"))
        wrong = http.get(server.url("/v1/models"), headers={"authorization": "Bearer nope"})
        allowed = http.get(server.url("/v1/models"), headers={"authorization": "Bearer s3cret"})
        health = http.get(server.url("/health"))
    for response in (refused, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.headers[API_SERVER_HEADER].startswith("ApiServer")
    assert allowed.status_code == 200 and allowed.json()["data"][0]["id"] == MODEL
    assert health.status_code == 200
    assert allowed.headers[API_SERVER_HEADER] == health.headers[API_SERVER_HEADER]


def test_the_engine_measures_the_floor_on_its_own_weights(guarded_bf16_server: PlugserveServer):
    """GET /bench/weight_read: the engine reads its packed weights between two steps and
    answers the batch-1 bandwidth floor; where it keeps no single weight buffer (fp32
    here), it says so in OpenAI's error shape; bad arguments are 400s."""
    server = guarded_bf16_server
    with httpx.Client(timeout=30) as http:
        read = http.get(server.url("/bench/weight_read"), params={"seconds": 0.2})
        too_long = http.get(server.url("/bench/weight_read"), params={"seconds": 60})
        no_engine = http.get(server.url("/bench/weight_read"), params={"engine": 2})
    # The suite's pinned plan (tests/conftest.py): cpu_gemm's single weight buffer exists
    # wherever the plan gives it a bucket.
    if "own" not in pinned_plan().libraries():
        assert_openai_error(read, 409)
    else:
        assert read.status_code == 200, read.text
        body = read.json()
        assert body["engine"] == 0
        assert body["weight_bytes"] == pytest.approx(269_030_016, rel=0.01)  # packed ≈ raw
        assert 0.1 < body["read_bandwidth_gb_s"] < 10_000
        expected_floor = body["weight_bytes"] / (body["read_bandwidth_gb_s"] * 1e9) * 1e3
        assert body["floor_ms"] == pytest.approx(expected_floor, rel=0.01)
    assert "seconds" in assert_openai_error(too_long, 400)["message"]
    assert "no engine 2" in assert_openai_error(no_engine, 400)["message"]


def test_an_fp32_engine_says_it_has_no_weight_buffer_to_read(server: PlugserveServer):
    response = httpx.get(server.url("/bench/weight_read"), params={"seconds": 0.1}, timeout=30)
    assert "no single weight buffer" in assert_openai_error(response, 409)["message"]
