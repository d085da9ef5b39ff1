"""Data parallelism: two engine-core processes behind one API server give the same greedy
outputs as one engine, and new requests are spread over both. One engine lost (kill -9
of its mp worker; on the Ray executor, the node its actor runs on) fails only the
request it had, within seconds, while the other engine's request streams on; /health
then says the server is degraded, and new requests are answered by the engine left, as
one engine answers them.

On the Ray executor (over the session's two-node local cluster) each engine places its
actor in a placement group of its own, and the two engines' groups lie on different
nodes. That server serves two tests in order: the placement first, then the loss of an
engine, which leaves it with one."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from plugserve.bench.plugserve_server import ENGINE_TITLE, PlugserveServer
from plugserve.bench.processes import descendants_of, process_cmdline

from .conftest import (
    COMPLETION_PROMPTS,
    LONG_MAX_TOKENS,
    MAX_TOKENS,
    MODEL,
    SERVER_SETTINGS,
    running_server,
)

PROMPTS = COMPLETION_PROMPTS * 2


async def _complete_all(server) -> list[str]:
    async with server.async_openai_client() as client:

        async def one(prompt: str) -> str:
            out = await client.completions.create(
                model="smollm2-135m-instruct", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            return out.choices[0].text

        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


TWO_ENGINES = (*SERVER_SETTINGS, "--data-parallel-size", "2")


@pytest.mark.starts_server(settings=TWO_ENGINES)
def test_two_engines_match_one_and_share_the_load(transport, reference, tmp_path):
    with running_server(transport, tmp_path, settings=TWO_ENGINES) as server:
        titles = sorted(
            process_cmdline(pid)
            for pid in descendants_of(server.pid)
            if ENGINE_TITLE in process_cmdline(pid)
        )
        assert titles == ["plugserve::EngineCore_DP0", "plugserve::EngineCore_DP1"]
        texts = asyncio.run(_complete_all(server))
        metrics = server.wait_idle()
    expected = [out.outputs[0].text for out in reference.completions(PROMPTS)]
    assert texts == expected
    per_engine = [metrics[f'engine_requests_total{{engine="{i}"}}'] for i in range(2)]
    assert sum(per_engine) == len(PROMPTS) and min(per_engine) >= len(PROMPTS) // 4
    assert metrics["kv_cache_usage"] == 0 and metrics["num_requests_running"] == 0


# --------------------------------------------------------------------------- one engine lost

LONG = {
    "model": MODEL,
    "prompt": "Once upon a time",
    "temperature": 0,
    "max_tokens": LONG_MAX_TOKENS,
    "extra_body": {"ignore_eos": True},
}
FAILED_WITHIN_S = 5.0  # from the loss to the error of the request on the lost engine
CHUNKS_AFTER = 3  # what the other engine's request must stream after that error


@dataclass
class EngineLoss:
    """What losing one engine of two did: the error that ended the request on it, the
    seconds from the loss to that error, and whether the other request streamed on."""

    error: openai.APIError
    seconds: float
    other_streamed_on: bool


def lose_engine(server: PlugserveServer, lost: int, end_it: Callable[[], object]) -> EngineLoss:
    """Stream a long request on each engine of an idle server (the first sent goes to
    engine 0, the second to engine 1: with equal loads the lower index wins), call
    `end_it()` to end engine `lost`, and watch both requests."""
    started = [threading.Event(), threading.Event()]
    failures: list[tuple[openai.APIError, float]] = []
    streamed_after = [0, 0]

    def stream(engine: int) -> None:
        with server.openai_client(timeout=120) as client:
            try:
                for _ in client.completions.create(**LONG, stream=True):
                    started[engine].set()
                    if failures:
                        streamed_after[engine] += 1
                        if streamed_after[engine] == CHUNKS_AFTER:
                            return  # it streams on; leaving it aborts it
            except openai.APIError as exc:
                failures.append((exc, time.monotonic()))

    with ThreadPoolExecutor(2) as pool:
        requests = []
        for engine in (0, 1):
            requests.append(pool.submit(stream, engine))
            assert started[engine].wait(60), f"the request on engine {engine} never started"
        ended = time.monotonic()
        end_it()
        for request in requests:
            request.result(timeout=120)
    ((error, failed_at),) = failures
    return EngineLoss(error, failed_at - ended, streamed_after[1 - lost] == CHUNKS_AFTER)


def assert_serves_on_without(
    server: PlugserveServer, lost: int, loss: EngineLoss, reference: Any
) -> str:
    """The request on engine `lost` failed in OpenAI's error shape (503) within
    FAILED_WITHIN_S, the other went on; /health answers 200, degraded, naming the lost
    engine and why; new requests all go to the other engine and answer as one engine
    does. Returns the lost request's error message."""
    print(f"the request on the lost engine failed {loss.seconds:.2f} s after the loss")
    assert loss.seconds < FAILED_WITHIN_S
    assert type(loss.error) is openai.APIError, loss.error  # an error event, not a cut
    body = loss.error.body
    assert isinstance(body, dict) and body.keys() == {"message", "type", "param", "code"}
    assert (body["type"], body["param"], body["code"]) == ("server_error", None, 503)
    assert f"EngineCore_DP{lost}" in body["message"], body
    assert loss.other_streamed_on, "the request on the other engine ended too"

    health = httpx.get(server.url("/health"), timeout=30)
    assert health.status_code == 200, health.text
    engines: list[dict[str, Any]] = [{"index": i, "status": "serving"} for i in range(2)]
    engines[lost] = {"index": lost, "status": "out_of_service", "reason": body["message"]}
    assert health.json() == {"status": "degraded", "engines": engines}

    requests = f'engine_requests_total{{engine="{lost}"}}'
    before = server.wait_idle()[requests]
    texts = asyncio.run(_complete_all(server))
    assert texts == [out.outputs[0].text for out in reference.completions(PROMPTS)]
    idle = server.wait_idle()
    assert idle[requests] == before
    assert (idle["num_requests_running"], idle["kv_cache_usage"]) == (0, 0)
    assert server.popen.poll() is None, "the server exited"
    return body["message"]


# A collective timeout past the test's own waits: only the executor watching its workers
# can end the request in time.
TWO_MP_ENGINES = (
    *TWO_ENGINES,
    "--stack.executor", "mp",
    "--plugins.mp.collective_timeout_s", "3600",
)  # fmt: skip


@pytest.mark.starts_server(transport="zmq", settings=TWO_MP_ENGINES)
def test_a_killed_worker_takes_only_its_engine_out_of_service(reference, tmp_path):
    with running_server("zmq", tmp_path, settings=TWO_MP_ENGINES) as server:
        [engine_one] = [p for p in server.engine_pids() if process_cmdline(p).endswith("_DP1")]
        [worker] = [p for p in descendants_of(engine_one) if "Worker_TP0" in process_cmdline(p)]
        loss = lose_engine(server, 1, lambda: os.kill(worker, signal.SIGKILL))
        message = assert_serves_on_without(server, 1, loss, reference)
        assert message.startswith(
            "the engine core EngineCore_DP1 failed: RuntimeError: "
            f"Worker_TP0 (pid {worker}) died unexpectedly: it was killed by SIGKILL"
        ), message


# --------------------------------------------------------------------------- on Ray


@pytest.fixture(scope="module")
def ray_engines(ray_cluster, tmp_path_factory) -> Iterator[PlugserveServer]:
    """Two engines on the Ray executor, joined to the session's two-node cluster."""
    settings = (
        *TWO_ENGINES,
        "--stack.executor", "ray",
        "--plugins.ray.address", ray_cluster.address,
        "--plugins.ray.collective_timeout_s", "3600",
    )  # fmt: skip
    with running_server("zmq", tmp_path_factory.mktemp("ray-dp"), settings=settings) as server:
        yield server


def engine_nodes(server: PlugserveServer) -> dict[int, list[str]]:
    """The node of each bundle of each engine's placement group, by engine index."""
    import ray

    groups = ray.util.placement_group_table().values()
    pids = {int(process_cmdline(pid).rpartition("_DP")[2]): pid for pid in server.engine_pids()}
    placed = {}
    for engine, pid in pids.items():
        [group] = [g for g in groups if g["name"] == f"plugserve-dp{engine}-{pid}"]
        assert group["state"] == "CREATED", group
        placed[engine] = [group["bundles_to_node_id"][b] for b in sorted(group["bundles"])]
    return placed


@pytest.mark.ray
def test_on_ray_two_engines_are_placed_on_different_nodes_and_match_one(ray_engines, reference):
    nodes = engine_nodes(ray_engines)
    assert nodes[0] != nodes[1], f"both engines on {nodes[0]}"
    texts = asyncio.run(_complete_all(ray_engines))
    assert texts == [out.outputs[0].text for out in reference.completions(PROMPTS)]


@pytest.mark.ray
def test_on_ray_a_lost_node_takes_only_the_engine_on_it_out_of_service(
    ray_engines, ray_cluster, reference
):
    head = ray_cluster.head_node.node_id
    nodes = engine_nodes(ray_engines)
    [lost] = [engine for engine, placed in nodes.items() if head not in placed]
    [node] = [n for n in ray_cluster.worker_nodes if n.node_id in nodes[lost]]
    try:
        loss = lose_engine(
            ray_engines, lost, lambda: ray_cluster.remove_node(node, allow_graceful=False)
        )
        message = assert_serves_on_without(ray_engines, lost, loss, reference)
        assert "Worker_TP0" in message, message
    finally:
        # The session's cluster has two nodes again for whatever runs next.
        ray_cluster.add_node(num_cpus=2)
        ray_cluster.wait_for_nodes()
