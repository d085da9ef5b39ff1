"""The Ray executor (`stack.executor: ray`): one Ray actor per rank, placed on a Ray
cluster, for tensor and pipeline parallelism across machines.

`pip install 'plugserve[ray]'`. Ray is imported only where this executor is built (the
engine-core process); the registry loads this module in every process, and nothing
here imports ray at module level.

**Placement.** One placement-group bundle per pipeline stage, holding the stage's
tensor-parallel ranks (`num_cpus_per_worker` CPUs each, and a GPU each on CUDA): a
bundle lies on one node, so a stage's all-reduces never leave it, while the stages are
spread over the nodes (`stage_strategy`, SPREAD by default: the engine then uses every
node it can). The actors (`ray_worker.RankActor`) join one torch.distributed group
through a rendezvous on rank 0's node and run the model runner unchanged.

**Data parallelism.** Each engine core is a Ray driver of its own and places its ranks
in a placement group of its own, which lives and dies with it: an engine that fails
takes its actors and their placement along and leaves the other engines' alone. So
that the engines land on different nodes, every engine lists the cluster's nodes that
can hold a stage's bundle, in the same order (by node id), and pins stage s of engine
`data_parallel_rank` d to node (d x stages + s) modulo their count, through the
placement group's per-bundle label selector on `ray.io/node-id`: with as many nodes as
engines x stages, no two bundles share a node.

**A step** is one batched round trip: the engine's two calls (execute, then sample
under the grammar bitmask) become one `StageCommand` put once in Ray's object store and
handed to every actor in one `run` call each; only the output rank (the last stage's
first) returns the sampled tokens. With several stages the executor runs batches
concurrently (capabilities.RunsBatchesConcurrently), one per stage in flight.

**Failure.** Every actor sends the executor heartbeats over TCP (heartbeat.py), watched
while the executor waits for a batch, beside the Ray calls of every rank: an actor
killed, or a node whose raylet is killed (its workers exit with it), closes its
connection and fails the requests in flight at once; a frozen node fails them after
`heartbeat_timeout_s`. A call that raised in an actor (a collective broken by a dead
peer) fails them too, naming the rank. Ray's own detection of a dead node waits for its
health checks (tens of seconds by default); this does not. The engine then reports
the failure like any executor's: the server exits, or with data parallelism only this
engine goes out of service.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections import deque
from concurrent.futures import Future
from select import select
from typing import Any, Literal, NoReturn

import msgspec
from pydantic import BaseModel, Field

from plugserve import hookimpl
from plugserve.config import StackConfig
from plugserve.datatypes import (
    GrammarOutput,
    MessageCounts,
    ModelRunnerOutput,
    RankLayout,
    SampledTokenRelay,
    SchedulerOutput,
    output_rank,
)
from plugserve.interfaces.executor import KVCacheInfo
from plugserve_plugins.executors.heartbeat import PeerHeartbeats

logger = logging.getLogger(__name__)

# How long one wait for a batch sleeps before looking at the heartbeats again; a reply
# wakes it at once.
_POLL_S = 0.05
# Every node's own label: a bundle selecting it is placed on that node.
_NODE_ID_LABEL = "ray.io/node-id"


class RayOptions(BaseModel):
    """`plugins: {ray: {...}}` in stack.yaml."""

    # The cluster to join ("auto": the one `ray start` runs on this machine, or
    # RAY_ADDRESS; "ray://host:10001" for a client). None: start a local one.
    address: str | None = None
    num_cpus_per_worker: float = Field(1.0, gt=0)
    # How the stages' bundles spread over the nodes (Ray's placement strategies).
    stage_strategy: Literal["SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"] = "SPREAD"
    placement_timeout_s: float = Field(120.0, gt=0)
    collective_timeout_s: float = Field(60.0, gt=0)
    heartbeat_interval_s: float = Field(0.1, gt=0)
    # An actor's heartbeat thread shares its GIL with the model runner: more slack than
    # the mp executor's node processes, which do nothing else.
    heartbeat_timeout_s: float = Field(3.0, gt=0)


class _Batch(Future):  # type: ignore[type-arg]
    """submit_batch's Future: resolved when asked for, by waiting on its rank calls."""

    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        super().__init__()
        self._executor = executor
        self.refs = refs

    def result(self, timeout: float | None = None) -> Any:
        while not self.done():
            self._executor._resolve_next()
        return super().result(timeout=0)


class RayExecutor:
    Options = RayOptions

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("ray") is None:
            return "ray is not installed: pip install 'plugserve[ray]'"
        return None

    def __init__(self, *, config: StackConfig, options: RayOptions | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from plugserve.device import resolve_device
        from plugserve_plugins.executors.ray_worker import RankActor

        engine = config.engine
        self.options = options = options or RayOptions()
        if engine.nnodes != 1:
            raise ValueError(
                "executor 'ray' places the ranks on the cluster itself: leave nnodes at 1 "
                "(it is the mp executor's setting)"
            )
        tp, stages = engine.tensor_parallel_size, engine.pipeline_parallel_size
        self.tensor_parallel_size, self.pipeline_parallel_size = tp, stages
        self.world_size = tp * stages
        self._output_rank = output_rank(tp, stages)
        self._names = [f"Worker_{RankLayout(r, tp, stages).name}" for r in range(self.world_size)]
        self._started_ray = not ray.is_initialized() and options.address is None
        if not ray.is_initialized():
            # "local": a Ray of this server's own, never one that happens to run on this
            # host (ray.init() with no address attaches to the latest local cluster).
            ray.init(address=options.address or "local", log_to_driver=True)
        gpus = 1 if resolve_device(engine.device).type == "cuda" else 0
        bundle = {"CPU": options.num_cpus_per_worker * tp, **({"GPU": tp} if gpus else {})}
        self.stage_nodes = _engine_nodes(
            bundle, stages, engine.data_parallel_size, engine.data_parallel_rank
        )
        self._placement = placement_group(
            [bundle] * stages,
            strategy=options.stage_strategy,
            name=f"plugserve-dp{engine.data_parallel_rank}-{os.getpid()}",
            bundle_label_selector=(
                None
                if self.stage_nodes is None
                else [{_NODE_ID_LABEL: node} for node in self.stage_nodes]
            ),
        )
        try:
            ray.get(self._placement.ready(), timeout=options.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self._placement)
            raise RuntimeError(
                f"the Ray cluster cannot place {stages} stage(s) of {bundle} "
                f"({options.stage_strategy}) within {options.placement_timeout_s} s: "
                f"it has {ray.available_resources()}"
            ) from None
        actor_cls = ray.remote(RankActor)
        self._actors = [
            actor_cls.options(
                num_cpus=options.num_cpus_per_worker,
                num_gpus=gpus,
                name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=rank // tp
                ),
            ).remote(config.model_dump_json(), rank, tp, stages)
            for rank in range(self.world_size)
        ]
        host = ray.util.get_node_ip_address()
        self._heartbeats = PeerHeartbeats(
            host, 0, dict(enumerate(self._names)), options.heartbeat_timeout_s
        )
        self._heartbeat_host = host
        self._failure: str | None = None
        self._pending: deque[_Batch] = deque()
        self._open: dict[Any, int] = {}  # calls of non-output ranks not yet returned
        self._relay = SampledTokenRelay()
        self._staged: SchedulerOutput | None = None
        self._counts = MessageCounts()  # the engine's side: batches, calls, returns
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ModelRunnerOutput | None)
        logger.info(
            "placed %d Ray actors (tensor parallel size %d, pipeline stages %d, %s)",
            self.world_size,
            tp,
            stages,
            options.stage_strategy if self.stage_nodes is None else f"stages on {self.stage_nodes}",
        )

    # ------------------------------------------------------------------ executor API

    def initialize(self) -> KVCacheInfo:
        import ray

        master = ray.get(self._actors[0].rendezvous_address.remote())
        heartbeat = (self._heartbeat_host, self._heartbeats.port, self.options.heartbeat_interval_s)
        calls = [
            actor.start.remote(*master, self.options.collective_timeout_s, heartbeat)
            for actor in self._actors
        ]
        infos = [msgspec.msgpack.decode(raw, type=KVCacheInfo) for raw in self._gather(calls)]
        self._await_heartbeats()
        first = infos[0]
        # The ranks agreed on the smallest block count among themselves already.
        return KVCacheInfo(
            num_blocks=min(info.num_blocks for info in infos),
            block_size=first.block_size,
            dtype=first.dtype,
            max_model_len=first.max_model_len,
        )

    @property
    def max_concurrent_batches(self) -> int:
        """One batch per pipeline stage in flight (capabilities.RunsBatchesConcurrently)."""
        return self.pipeline_parallel_size

    def submit_batch(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None
    ) -> Future[ModelRunnerOutput]:
        import ray

        if self._failure is not None:
            raise RuntimeError(self._failure)
        command = self._relay.command(scheduler_output, grammar_output)
        encoded = self._encoder.encode(command)
        payload = ray.put(encoded)  # once, for every rank
        refs = [actor.run.remote(payload) for actor in self._actors]
        self._counts.batches += 1
        self._counts.commands += len(refs)
        self._counts.command_bytes += len(encoded) * len(refs)
        for rank, ref in enumerate(refs):
            if rank != self._output_rank:
                self._open[ref] = rank
        batch = _Batch(self, refs)
        self._pending.append(batch)
        return batch

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput | None] | ModelRunnerOutput | None:
        # The step goes out with its bitmask, in sample_tokens: one round trip.
        self._staged = scheduler_output
        if not non_block:
            return None
        staged: Future[ModelRunnerOutput | None] = Future()
        staged.set_result(None)
        return staged

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        if self._staged is None:
            raise RuntimeError("sample_tokens without execute_model")
        scheduler_output, self._staged = self._staged, None
        return self.submit_batch(scheduler_output, grammar_output).result()

    def check_health(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        self._check_heartbeats(0.0)

    def message_counts(self) -> MessageCounts:
        """capabilities.CountsMessages: the engine's side and every rank's."""
        while self._pending:  # the batches in flight keep their results for the engine
            self._resolve_next()
        for ref, rank in list(self._open.items()):  # every call's return, counted
            self._get(ref, rank)
            self._count_reply(None)
            del self._open[ref]
        calls = [actor.message_counts.remote() for actor in self._actors]
        counts = self._counts + MessageCounts()
        for raw in self._gather(calls):
            counts += msgspec.msgpack.decode(raw, type=MessageCounts)
        return counts

    def shutdown(self) -> None:
        if self._failure is None:
            self._failure = "the ray executor is shut down"
        self._release()

    # ------------------------------------------------------------------ plumbing

    def _resolve_next(self) -> None:
        """Wait for the oldest batch's sampled tokens, watching every rank meanwhile."""
        import ray

        batch = self._pending[0]
        output_ref = batch.refs[self._output_rank]
        try:
            while True:
                ready, _ = ray.wait([output_ref, *self._open], num_returns=1, timeout=_POLL_S)
                for ref in ready:
                    if ref is not output_ref:
                        rank = self._open.pop(ref)
                        self._get(ref, rank)  # raises what the rank's call raised
                        self._count_reply(None)
                if output_ref in ready:
                    break
                self._check_heartbeats(0.0)
            raw = self._get(output_ref, self._output_rank)
            self._count_reply(raw)
            output = self._decoder.decode(raw)
        except BaseException as exc:
            for pending in self._pending:
                pending.set_exception(exc)
            self._pending.clear()
            raise
        self._pending.popleft()
        if output is not None:
            self._relay.record(output)
        batch.set_result(output)

    def _count_reply(self, raw: bytes | None) -> None:
        self._counts.replies += 1
        self._counts.reply_bytes += 0 if raw is None else len(raw)

    def _get(self, ref: Any, rank: int) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayError as error:
            died = isinstance(error, ray.exceptions.RayActorError)
            reason = f"{self._names[rank]} {'died' if died else 'failed'}: {_first_line(error)}"
        # A rank whose collective broke fails because a peer went: name the peer first.
        self._check_heartbeats(_POLL_S)
        self._fail(reason)

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every call's result, failing at the first that raises or whose actor dies."""
        import ray

        results: dict[Any, Any] = {}
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=_POLL_S)
            for ref in ready:
                results[ref] = self._get(ref, rank_of[ref])
            self._check_heartbeats(0.0)
        return [results[ref] for ref in refs]

    def _await_heartbeats(self) -> None:
        give_up = time.monotonic() + self.options.collective_timeout_s
        while not self._heartbeats.all_joined:
            if time.monotonic() > give_up:
                self._fail("the actors started, but their heartbeats never reached the executor")
            self._check_heartbeats(_POLL_S)
        self._heartbeats.watch_silence()

    def _check_heartbeats(self, timeout: float) -> None:
        ready, _, _ = select(self._heartbeats.waitables(), [], [], timeout)
        gone = self._heartbeats.check(ready)
        if gone is not None:
            self._fail(gone)

    def _fail(self, reason: str) -> NoReturn:
        if self._failure is None:
            self._failure = reason
            logger.error("Ray actors failed: %s", reason)
            self._release()
        raise RuntimeError(self._failure)

    def _release(self) -> None:
        """Kill the actors and free their placement (each at most once)."""
        import ray

        actors, self._actors = self._actors, []
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception as error:  # already gone with its node
                logger.debug("ray.kill: %s", _first_line(error))
        if self._placement is not None:
            try:
                ray.util.remove_placement_group(self._placement)
            except Exception as error:
                logger.debug("remove_placement_group: %s", _first_line(error))
            self._placement = None
        self._heartbeats.close()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def _engine_nodes(
    bundle: dict[str, float], stages: int, num_engines: int, engine: int
) -> list[str] | None:
    """The node of each stage of data-parallel engine `engine`, round robin over the
    nodes that can hold a stage's `bundle` (in node-id order, which every engine sees
    alike); None with one engine (its stages follow `stage_strategy`) or where no node
    fits (the placement's timeout then says what the cluster has)."""
    import ray

    if num_engines == 1:
        return None
    nodes = sorted(
        node["NodeID"]
        for node in ray.nodes()
        if node["Alive"] and all(node["Resources"].get(k, 0) >= v for k, v in bundle.items())
    )
    if not nodes:
        return None
    return [nodes[(engine * stages + stage) % len(nodes)] for stage in range(stages)]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@hookimpl
def register_executors(register):
    register("ray", RayExecutor)
