"""/metrics as a vLLM dashboard reads it, from a real server: vLLM's names and types, with
values that match what was served (a preemption among them), summed over two API
servers whichever answers the scrape; a metrics plugin's own collectors; no engine ping
per scrape; the engine's periodic line, none while idle; and engine.dtype auto, with the
start-up line saying why.

One server serves most of this module: two API servers, engine.dtype auto (bf16 on a CPU
with native bf16), the test metrics plugin (tests/integration/metrics_plugin.py), a
short engine.log_stats_interval and a KV cache of four blocks, as long as the context,
so that two requests preempt. One more starts as on a CPU without native bf16.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from plugserve.bench.plugserve_server import PlugserveServer
from plugserve.bench.server_process import wait_until
from tests.integration.conftest import (
    API_SERVER_HEADER,
    CHAT_CONVERSATIONS,
    COMPLETION_PROMPTS,
    MODEL,
    REPO_ROOT,
    SERVER_SETTINGS,
    running_server,
)
from tests.integration.metrics_plugin import ANSWERED_BY, REGISTRATIONS

# SERVER_SETTINGS pins fp32 for the tests that compare text; here engine.dtype is auto.
_DTYPE_AT = SERVER_SETTINGS.index("--dtype")
AUTO_DTYPE_SETTINGS = SERVER_SETTINGS[:_DTYPE_AT] + SERVER_SETTINGS[_DTYPE_AT + 2 :]
LOG_STATS_INTERVAL_S = 0.5
# The metrics server's KV cache: four blocks of 16 tokens (the default block size), and a
# context just as long, so that one request generating to the end of its context ends
# holding every block.
KV_BLOCKS = 4
CONTEXT_TOKENS = KV_BLOCKS * 16

VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}
# One observation per request.
PER_REQUEST_HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
]


def _cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.split()
    return []


NATIVE_BF16 = [flag for flag in ("avx512_bf16", "amx_bf16") if flag in _cpu_flags()]


@dataclass
class Scrape:
    answered_by: str  # x-plugserve-api-server: "ApiServer_1 pid=42"
    families: dict[str, Metric]

    def value(self, name: str, suffix: str = "", **labels: str) -> float:
        """The sum of `name`'s samples named name + suffix with these labels."""
        return sum(
            sample.value
            for sample in self.families[name].samples
            if sample.name == name + suffix
            and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    @property
    def pid(self) -> int:
        return int(self.answered_by.rpartition("pid=")[2])


def scrape(server: PlugserveServer) -> Scrape:
    # A connection of its own each time: the kernel spreads them over the API servers.
    response = httpx.get(server.url("/metrics"), timeout=10)
    assert response.status_code == 200, response.text
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    return Scrape(response.headers[API_SERVER_HEADER], families)


def scrapes_from_every_api_server(server: PlugserveServer, count: int = 2) -> list[Scrape]:
    """Scrapes until `count` different API servers have answered (one scrape of each)."""
    by_process: dict[str, Scrape] = {}
    for _ in range(60):
        each = scrape(server)
        by_process.setdefault(each.answered_by, each)
        if len(by_process) == count:
            return list(by_process.values())
    raise AssertionError(f"only {sorted(by_process)} answered 60 scrapes")


@dataclass
class Served:
    answered_by: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def serve_one(server: PlugserveServer, index: int) -> Served:
    """Request `index` of the workload, on a connection of its own: completions and chat,
    streamed (with usage in its last chunk) and not; every chat the same conversation, so
    that the prefix cache has hits."""
    streamed, chat = index % 2 == 1, index % 4 >= 2
    body: dict = {"model": MODEL, "temperature": 0, "max_tokens": 8}
    if chat:
        path, body["messages"] = "/v1/chat/completions", CHAT_CONVERSATIONS[0]
    else:
        path, body["prompt"] = "/v1/completions", COMPLETION_PROMPTS[index % 3]
    with httpx.Client(timeout=120) as http:
        if not streamed:
            response = http.post(server.url(path), json=body)
            assert response.status_code == 200, response.text
            data = response.json()
            usage, finish = data["usage"], data["choices"][0]["finish_reason"]
            return Served(
                response.headers[API_SERVER_HEADER],
                usage["prompt_tokens"],
                usage["completion_tokens"],
                finish,
            )
        body.update(stream=True, stream_options={"include_usage": True})
        with http.stream("POST", server.url(path), json=body) as response:
            assert response.status_code == 200
            answered_by = response.headers[API_SERVER_HEADER]
            chunks = [
                json.loads(line.removeprefix("data: "))
                for line in response.iter_lines()
                if line.startswith("data: {")
            ]
    [usage] = [c["usage"] for c in chunks if c.get("usage")]
    finishes = [
        choice["finish_reason"]
        for c in chunks
        for choice in c.get("choices", [])
        if choice.get("finish_reason")
    ]
    return Served(answered_by, usage["prompt_tokens"], usage["completion_tokens"], finishes[-1])


_AT = AUTO_DTYPE_SETTINGS.index("--max-model-len")
METRICS_SETTINGS = (
    *AUTO_DTYPE_SETTINGS[:_AT], *AUTO_DTYPE_SETTINGS[_AT + 2 :],
    "--max-model-len", str(CONTEXT_TOKENS),
    "--num-kv-blocks", str(KV_BLOCKS),
    "--api-server-count", "2",
    "--log-stats-interval", str(LOG_STATS_INTERVAL_S),
)  # fmt: skip
METRICS_ENV = {
    "PLUGSERVE_PLUGIN_MODULES": "tests.integration.metrics_plugin",
    "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
}
HIDDEN_BF16_ENV = {"PLUGSERVE_HIDE_CPU_FLAGS": "avx512_bf16,amx_bf16"}


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlugserveServer]:
    log_dir = tmp_path_factory.mktemp("metrics")
    with running_server("zmq", log_dir, settings=METRICS_SETTINGS, env=METRICS_ENV) as server:
        yield server


@pytest.mark.starts_server(transport="zmq", settings=METRICS_SETTINGS, env=METRICS_ENV)
def test_vllm_metrics_count_what_was_served_over_both_api_servers(metrics_server):
    """Requests answered by both API servers, one at a time: whichever API server answers
    a scrape, every vLLM name has its type and the figures of all of them: tokens equal
    the usage the responses reported, successes count their finish reasons, each
    per-request histogram counts every request, the inter-token one every token after a
    request's first, and the engine ends idle."""
    server = metrics_server
    before = scrape(server)
    served: list[Served] = []
    while len(served) < 8 or len({s.answered_by for s in served}) < 2:
        assert len(served) < 40, "one API server answered every request"
        served.append(serve_one(server, len(served)))

    def done() -> Scrape | None:
        now = scrape(server)
        finished = now.value("vllm:request_success", "_total") - before.value(
            "vllm:request_success", "_total"
        )
        idle = (
            now.value("vllm:num_requests_running") == 0
            and now.value("vllm:kv_cache_usage_perc") == 0
        )
        return now if finished == len(served) and idle else None

    assert wait_until(done, 10), "the figures never reached the served requests"
    figures = []
    for after in scrapes_from_every_api_server(server):
        for name, kind in VLLM_METRICS.items():
            family = after.families[name]
            assert family.type == kind, name
            assert family.samples, name
            for sample in family.samples:
                assert sample.labels["model_name"] == MODEL, sample
                assert sample.labels["engine"] == "0", sample

        def delta(name: str, suffix: str = "", after: Scrape = after, **labels: str) -> float:
            return after.value(name, suffix, **labels) - before.value(name, suffix, **labels)

        prompt_tokens = sum(s.prompt_tokens for s in served)
        completion_tokens = sum(s.completion_tokens for s in served)
        assert delta("vllm:prompt_tokens", "_total") == prompt_tokens
        assert delta("vllm:generation_tokens", "_total") == completion_tokens
        for reason in ("stop", "length", "abort", "error"):
            expected = sum(s.finish_reason == reason for s in served)
            assert delta("vllm:request_success", "_total", finished_reason=reason) == expected
        for name in PER_REQUEST_HISTOGRAMS:
            assert delta(name, "_count") == len(served), name
        assert delta("vllm:request_prompt_tokens", "_sum") == prompt_tokens
        assert delta("vllm:request_generation_tokens", "_sum") == completion_tokens
        # One request at a time: each engine step brought each request one token.
        itl = delta("vllm:inter_token_latency_seconds", "_count")
        assert itl == sum(s.completion_tokens - 1 for s in served)
        assert delta("vllm:time_to_first_token_seconds", "_sum") > 0
        assert delta("vllm:e2e_request_latency_seconds", "_sum") >= delta(
            "vllm:time_to_first_token_seconds", "_sum"
        )
        hits = delta("vllm:prefix_cache_hits", "_total")
        assert 0 < hits <= delta("vllm:prefix_cache_queries", "_total")  # the same chat
        # One request at a time fits the pool: nothing is preempted.
        assert delta("vllm:num_preemptions", "_total") == 0
        assert after.value("vllm:num_requests_running") == 0
        assert after.value("vllm:num_requests_waiting") == 0
        assert after.value("vllm:kv_cache_usage_perc") == 0
        figures.append(
            {
                name: after.value(name, suffix)
                for name, suffix in (
                    ("vllm:prompt_tokens", "_total"),
                    ("vllm:generation_tokens", "_total"),
                    ("vllm:request_success", "_total"),
                    ("vllm:prefix_cache_hits", "_total"),
                    ("plugserve_engine_steps", "_total"),
                )
            }
        )
    assert figures[0] == figures[1]  # the same whichever API server answered


def test_two_prompts_that_outgrow_the_kv_cache_together_are_preempted_once(metrics_server):
    """Two prompts of one request, each generating to the end of the context, which is as
    long as the KV cache: alone, each ends holding every block. Once both run, the pool
    runs dry before the first is done; fcfs preempts the later-admitted one, which cannot
    come back while the first runs (fewer blocks are left than its tokens need), and once
    the first has finished the pool holds it alone. So the engine preempts exactly once,
    whichever steps the two were admitted at. Both prompts still get every token; vLLM's
    counter and plugserve's own (the engine's figure) say one, whichever API server
    answers the scrape.

    Both do run at once: the API server sends the two prompts to the engine in one turn of
    its event loop, and the second would only wait (not run) if the first already held the
    whole pool, some 40 decode steps after its start."""
    server = metrics_server
    prompt_len = 8
    # Different tokens, so that neither finds the other's blocks in the prefix cache.
    prompts = [[1000 + i for i in range(prompt_len)], [2000 + i for i in range(prompt_len)]]
    max_tokens = CONTEXT_TOKENS - prompt_len
    before = scrape(server)
    body = {"model": MODEL, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=300)
    assert response.status_code == 200, response.text
    data = response.json()
    assert [c["finish_reason"] for c in data["choices"]] == ["length", "length"]
    assert data["usage"]["completion_tokens"] == 2 * max_tokens

    def idle() -> Scrape | None:
        now = scrape(server)
        finished = now.value("vllm:request_success", "_total")
        done = finished == before.value("vllm:request_success", "_total") + 2
        return now if done and now.value("vllm:kv_cache_usage_perc") == 0 else None

    assert wait_until(idle, 10), "the engine's figures never showed both requests finished"
    for after in scrapes_from_every_api_server(server):
        for name in ("vllm:num_preemptions", "plugserve_preemptions"):
            assert after.value(name, "_total") - before.value(name, "_total") == 1, (
                name,
                after.answered_by,
            )


def test_a_scrape_asks_no_engine_anything(metrics_server):
    """The engine's ping counter stands still over scrapes; one /health moves it by one
    (each API server pings the engine itself: the pong's count reaches the sum)."""
    server = metrics_server

    def pings() -> float:
        return scrape(server).value("plugserve_engine_pings", "_total")

    first = pings()
    assert [pings() for _ in range(6)] == [first] * 6
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    assert wait_until(lambda: pings() == first + 1, 10)


def test_a_metrics_plugin_adds_its_collectors_in_every_api_server(metrics_server):
    """The register_metrics hook ran once in each API-server process: its counter sums to
    2 (served once, not once per process), and its collector runs in whichever process
    answers the scrape."""
    for each in scrapes_from_every_api_server(metrics_server):
        [sample] = each.families[ANSWERED_BY].samples
        assert sample.labels == {"model_name": MODEL}
        assert sample.value == each.pid
        assert each.value(REGISTRATIONS, "_total") == 2


def test_a_busy_spell_ends_with_the_engines_line_and_an_idle_engine_logs_none(metrics_server):
    """vLLM's periodic line, from the engine process: a busy spell ends with a line that
    finds the engine idle, and none follows while it stays idle."""
    server = metrics_server

    def lines() -> list[str]:
        return [line for line in server.log_text().splitlines() if "Avg prompt throughput" in line]

    body = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, "max_tokens": 48}
    body.update(ignore_eos=True, stream=True)
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=120) as response:
        assert response.status_code == 200
        events = (line for line in response.iter_lines() if line.startswith("data: {"))
        next(events)
        # Every line the engine wrote before this request is in the log by now (it wrote
        # them before computing the token that just arrived): the lines after these are
        # this request's busy spell.
        before = len(lines())
        for _ in events:
            pass

    def spell_end() -> str | None:
        return next((line for line in lines()[before:] if "Running: 0 reqs" in line), None)

    # The deadline only bounds a failure: the line comes one interval after the spell.
    line = wait_until(spell_end, 30)
    assert line, server.log_tail()
    assert " EngineCore pid=" in line and "Engine 000:" in line
    for part in ("Avg generation throughput:", "Waiting: 0 reqs", "KV cache usage: 0.0%"):
        assert part in line, line
    assert "Prefix cache hit rate:" in line
    assert lines()[-1] == line
    # Idle from here on. Three intervals in which a line would be due, then two health
    # checks, each a turn of the engine's loop: one due line would be written in the
    # first turn, before the second check is answered.
    settled = len(lines())
    time.sleep(3 * LOG_STATS_INTERVAL_S)
    for _ in range(2):
        assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    assert len(lines()) == settled


def test_auto_dtype_is_bf16_on_a_cpu_with_native_bf16_and_says_why(metrics_server):
    log = metrics_server.log_text()
    if NATIVE_BF16:
        reason = f"dtype bfloat16 (auto: the CPU has {' and '.join(NATIVE_BF16)}); bf16 linears: "
    else:
        reason = "dtype float32 (auto: the CPU has neither avx512_bf16 nor amx_bf16)"
    assert reason in log, log


def _starts_a_hidden_bf16_server(test: Callable[..., None]) -> Callable[..., None]:
    """The test below starts a server of its own on a CPU with native bf16 only."""
    mark = pytest.mark.starts_server(
        transport="zmq", settings=AUTO_DTYPE_SETTINGS, env=HIDDEN_BF16_ENV
    )
    return mark(test) if NATIVE_BF16 else test


@_starts_a_hidden_bf16_server
def test_auto_dtype_is_float32_where_the_cpu_has_no_native_bf16(metrics_server, tmp_path):
    """The same CPU with its bf16 flags hidden (PLUGSERVE_HIDE_CPU_FLAGS, which every
    plugserve process honours) serves fp32 and says why. A CPU without them needs nothing
    hidden: the metrics server, which serves auto, is such a server."""
    hidden = (
        running_server("zmq", tmp_path, settings=AUTO_DTYPE_SETTINGS, env=HIDDEN_BF16_ENV)
        if NATIVE_BF16
        else contextlib.nullcontext(metrics_server)
    )
    with hidden as server:
        body = {"model": MODEL, "prompt": "Hello", "temperature": 0, "max_tokens": 2}
        response = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
        assert response.status_code == 200, response.text
        log = server.log_text()
    # fp32 on a CPU: the cpu_fp32 linear method, oneDNN or ATen as it timed them.
    expected = "dtype float32 (auto: the CPU has neither avx512_bf16 nor amx_bf16); fp32 linears: "
    assert expected in log, log
