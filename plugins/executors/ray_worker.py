"""The Ray executor's actor: one per rank (a tensor-parallel rank of a pipeline stage),
running the same ModelRunner an mp worker runs.

The executor makes it a Ray actor (`ray.remote(RankActor)`) where it places the ranks:
this module imports neither ray nor torch when loaded. An actor learns its place, joins
the torch.distributed group of every rank through the rendezvous rank 0's actor hosts
(gloo on CPU, nccl on CUDA), starts its heartbeats to the executor, builds its runner
and then runs one `StageCommand` per batch (worker/pipeline.py): the whole step, execute
and sample, in one call.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

import msgspec

from plugserve.config import StackConfig
from plugserve.datatypes import ModelRunnerOutput, RankLayout, StageCommand
from plugserve.interfaces.executor import KVCacheInfo
from plugserve.logging_utils import configure_process_logging
from plugserve.worker.pipeline import run_stage_command
from plugserve_plugins.executors.heartbeat import send_heartbeats

logger = logging.getLogger(__name__)


class RankActor:
    """One rank, built by the Ray executor on the node its placement group gave it."""

    def __init__(self, config_json: str, rank: int, tensor_parallel_size: int, stages: int) -> None:
        self.config = StackConfig.model_validate_json(config_json)
        self.layout = RankLayout(rank, tensor_parallel_size, stages)
        self.name = f"Worker_{self.layout.name}"
        configure_process_logging(self.name)
        self.runner: Any = None
        self._stop_beating = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(StageCommand)
        self._encoder = msgspec.msgpack.Encoder()

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for rank 0 to host the rendezvous."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
            return host, int(sock.getsockname()[1])

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def start(
        self,
        master_addr: str,
        master_port: int,
        collective_timeout_s: float,
        heartbeat: tuple[str, int, float],
    ) -> bytes:
        """Join the group, start the heartbeats, load the model; msgpack(KVCacheInfo)."""
        import torch

        from plugserve.device import resolve_device
        from plugserve.worker.model_runner import ModelRunner
        from plugserve.worker.parallel import init_parallel, join_groups

        host, port, interval_s = heartbeat
        send_heartbeats(host, port, self.layout.rank, interval_s, self._stop_beating)
        config = self.config
        if config.engine.num_threads is None:
            config.engine.num_threads = max(1, len(os.sched_getaffinity(0)))
        device = resolve_device(config.engine.device)
        parallel = placement = None
        if self.layout.world_size > 1:
            init_parallel(
                rank=self.layout.rank,
                world_size=self.layout.world_size,
                local_rank=0,  # Ray shows each actor only the GPU it was given
                master_addr=master_addr,
                master_port=master_port,
                device=device,
                timeout_s=collective_timeout_s,
            )
            parallel, placement = join_groups(self.layout, config.engine.pp_layer_partition)
        torch.set_grad_enabled(False)
        self.runner = ModelRunner(config, parallel, placement)
        info: KVCacheInfo = self.runner.initialize()
        logger.info("%s ready (%d KV blocks)", self.name, info.num_blocks)
        return msgspec.msgpack.encode(info)

    def run(self, command: bytes) -> bytes | None:
        """One batch: msgpack(ModelRunnerOutput) from the output rank, None elsewhere."""
        import torch

        with torch.inference_mode():
            output: ModelRunnerOutput | None = run_stage_command(
                self.runner, self._decoder.decode(command)
            )
        return None if output is None else self._encoder.encode(output)

    def message_counts(self) -> bytes:
        """msgpack(MessageCounts): this rank's collectives and stage sends."""
        from plugserve.worker.parallel import rank_message_counts

        return self._encoder.encode(rank_message_counts())

    def ping(self) -> str:
        return self.name

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self._stop_beating.set()
