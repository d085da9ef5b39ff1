"""The mp executor's worker processes from the outside: its options and what each worker
is given, how one died, stopping them all, and a free port for their rendezvous (mp.py
starts them, mp_worker.py runs inside one)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from pydantic import BaseModel, Field

from plugserve.config import StackConfig
from plugserve_plugins.executors.heartbeat import PeerHeartbeats
from plugserve_plugins.executors.mp_worker import SHUTDOWN, WorkerSpec


class MultiprocOptions(BaseModel):
    """`plugins: {mp: {...}}` in stack.yaml."""

    # Backstop for a collective whose peer died or a rendezvous a node never joins; the
    # executor notices a local death through sentinels long before.
    collective_timeout_s: float = Field(60.0, gt=0)
    # How long shutdown waits for workers to exit before terminating them.
    shutdown_timeout_s: float = Field(5.0, ge=0)
    # Across nodes: how often each other node sends node 0 a heartbeat, and after how
    # long without one node 0 declares it gone.
    heartbeat_interval_s: float = Field(0.1, gt=0)
    heartbeat_timeout_s: float = Field(1.0, gt=0)


def worker_spec(config: StackConfig, rank: int, port: int, options: MultiprocOptions) -> WorkerSpec:
    """What the worker of global rank `rank` is started with."""
    engine = config.engine
    world_size = engine.tensor_parallel_size * engine.pipeline_parallel_size
    local = world_size // engine.nnodes
    return WorkerSpec(
        config_json=config.model_dump_json(),
        rank=rank,
        local_rank=rank % local,
        world_size=world_size,
        tensor_parallel_size=engine.tensor_parallel_size,
        local_world_size=local,
        master_addr=engine.master_addr,
        master_port=port,
        relay=engine.nnodes > 1,
        parent_pid=os.getpid(),
        timeout_s=options.collective_timeout_s,
    )


def death_reason(name: str, proc: BaseProcess) -> str:
    """How the worker `name` ended, for the error that fails the engine."""
    proc.join(timeout=1.0)  # EOF can come a moment before the exit status
    code = proc.exitcode
    if code is None:
        how = "closed its pipe"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return f"{name} (pid {proc.pid}) died unexpectedly: it {how}"


def stop_workers(
    procs: list[BaseProcess],
    conns: list[Connection],
    timeout: float,
    heartbeats: PeerHeartbeats | None = None,
) -> None:
    """Ask politely, then terminate, then kill; never blocks much past `timeout`."""
    if heartbeats is not None:
        heartbeats.close()
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(SHUTDOWN)
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    for proc in procs:
        proc.join(timeout=1.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join(timeout=1.0)
    for conn in conns:
        conn.close()


def free_port(host: str) -> int:
    """A port free on `host` now, for the rendezvous rank 0 hosts."""
    # Rank 0 binds it moments later; another process taking it in between would fail
    # the rendezvous loudly, not silently. Set master_port to rule that out.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
