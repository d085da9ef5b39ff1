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

import pytest
import torch

from plugserve import LLM
from plugserve.worker.random_model import write_random_model
from tests.failure_support import fail_mid_request

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
