"""The Ray executor when a rank dies mid-request, on the session's two-node local Ray
cluster (tests/conftest.py: ray_cluster), two pipeline stages, one per node: kill -9 of
the last stage's actor process, and kill -9 of the second node's raylet and every
process of that node (ray.cluster_utils' remove_node without grace). Either way the
request in flight fails with an error naming the rank, from the actors' heartbeats,
within seconds; Ray's own node-death detection would wait for its health checks. The
collective timeout is an hour here, so that nothing else could end the request before
the test's own join gives up."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from plugserve import LLM, SamplingParams
from plugserve.worker.random_model import write_random_model

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    return str(write_random_model(folder, "tiny", dtype=torch.float32))


def two_stages(model: str) -> LLM:
    return LLM(
        model=model,
        executor="ray",
        pipeline_parallel_size=2,
        dtype="float32",
        kv_cache_memory="16MiB",
        num_threads=1,
        **{"plugins.ray.collective_timeout_s": 3600},
    )


def fail_mid_request(llm: LLM, end_rank) -> tuple[BaseException, float]:
    """Start a long request, call `end_rank()` once it decodes; the error it ended with
    and the seconds from `end_rank` to it."""
    errors: list[tuple[BaseException, float]] = []

    def long_generate() -> None:
        try:
            llm.generate("Once", SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
        except BaseException as exc:
            errors.append((exc, time.monotonic()))

    thread = threading.Thread(target=long_generate, daemon=True)  # a hang must not block exit
    thread.start()
    deadline = time.monotonic() + 120
    while not any(r.num_output_tokens > 2 for r in list(llm.engine.scheduler.running)):
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    ended = time.monotonic()
    end_rank()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the request outlived its rank"
    ((error, at),) = errors
    return error, at - ended


def test_an_actor_killed_mid_request_fails_it_naming_the_rank(ray_cluster, tiny_model) -> None:
    import ray

    llm = two_stages(tiny_model)
    try:
        last = llm.engine.executor._actors[-1]
        pid = ray.get(last.pid.remote())
        error, seconds = fail_mid_request(llm, lambda: os.kill(pid, signal.SIGKILL))
        print(f"actor of Worker_PP1_TP0 killed: the request failed after {seconds:.2f} s")
        assert isinstance(error, RuntimeError)
        assert "Worker_PP1_TP0" in str(error)
        with pytest.raises(RuntimeError, match="Worker_PP1_TP0"):
            llm.engine.executor.check_health()
    finally:
        llm.engine.shutdown()


def test_a_node_whose_raylet_is_killed_fails_the_request_naming_the_rank(
    ray_cluster, tiny_model
) -> None:
    import ray

    llm = two_stages(tiny_model)
    try:
        head = ray_cluster.head_node.node_id
        nodes = ray.get([a.node_id.remote() for a in llm.engine.executor._actors])
        [victim] = [n for n in ray_cluster.worker_nodes if n.node_id in nodes and n.node_id != head]
        rank = nodes.index(victim.node_id)
        name = ["Worker_PP0_TP0", "Worker_PP1_TP0"][rank]
        error, seconds = fail_mid_request(
            llm, lambda: ray_cluster.remove_node(victim, allow_graceful=False)
        )
        print(f"node of {name} killed: the request failed after {seconds:.2f} s")
        assert isinstance(error, RuntimeError)
        assert name in str(error)
    finally:
        llm.engine.shutdown()
        # The session's cluster has two nodes again for whatever runs next.
        ray_cluster.add_node(num_cpus=2)
        ray_cluster.wait_for_nodes()
