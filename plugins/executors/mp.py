"""The multi-process executor: one worker process per tensor-parallel rank.

The workers (`plugserve::Worker_TP{rank}`, see mp_worker.py) are spawned children of
the engine core and form one torch.distributed group (gloo on CPU, nccl on CUDA). Each
step the SchedulerOutput is msgpack-encoded once and written to every worker's pipe;
rank 0 answers for the group, since all ranks hold the same persistent batch and rank 0
broadcasts the tokens it samples.

Failure never hangs the engine: every wait watches rank 0's pipe, every worker's pipe
(a worker that raises sends its error line, then exits) and every worker's process
sentinel, so a dead or failing rank surfaces as a RuntimeError naming it at once. The
survivors, possibly stuck in a collective with the dead rank, are then killed.

Across nodes, node 0 runs the engine and this executor (ranks 0..local-1); every other
node runs `python -m plugserve_plugins.executors.mp --node-rank K [--config stack.yaml]
[-o key=value ...]` with the same settings, whose workers take their commands from
rank 0 over the process group (see mp_worker.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import time
import weakref
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import msgspec
from pydantic import BaseModel, Field

from plugserve import hookimpl
from plugserve.config import StackConfig, load_config
from plugserve.datatypes import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from plugserve.interfaces.executor import KVCacheInfo
from plugserve.logging_utils import configure_process_logging
from plugserve_plugins.executors.mp_worker import (
    ERROR,
    EXECUTE,
    READY,
    REPLY,
    SAMPLE,
    SHUTDOWN,
    WorkerSpec,
    set_title,
    worker_main,
)

logger = logging.getLogger(__name__)

_Output = ModelRunnerOutput | None


class MultiprocOptions(BaseModel):
    """`plugins: {mp: {...}}` in stack.yaml."""

    # Backstop for a collective whose peer died or a rendezvous a node never joins; the
    # executor notices a local death through sentinels long before.
    collective_timeout_s: float = Field(60.0, gt=0)
    # How long shutdown waits for workers to exit before terminating them.
    shutdown_timeout_s: float = Field(5.0, ge=0)


class _Reply(Future):  # type: ignore[type-arg]
    """execute_model's Future: resolved when its result is asked for, by reading rank 0's
    reply then, so no thread sits between the engine and the pipe."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._executor._resolve_pending(timeout)
        return super().result(timeout=0)


class MultiprocExecutor:
    Options = MultiprocOptions

    def __init__(self, *, config: StackConfig, options: MultiprocOptions | None = None) -> None:
        engine = config.engine
        self.options = options or MultiprocOptions()
        if engine.node_rank != 0:
            raise ValueError(
                f"node_rank {engine.node_rank} runs no engine: start it with "
                f"`python -m plugserve_plugins.executors.mp --node-rank {engine.node_rank}`"
            )
        self.world_size = engine.tensor_parallel_size
        local = self.world_size // engine.nnodes
        port = engine.master_port or _free_port(engine.master_addr)
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        ctx = multiprocessing.get_context("spawn")
        for rank in range(local):
            spec = _spec(config, rank, port, self.options)
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, child_end), name=spec.name)
            proc.daemon = True  # multiprocessing's atexit reaps them if all else fails
            proc.start()
            child_end.close()  # ours closed, EOF reaches us when the worker dies
            self._procs.append(proc)
            self._conns.append(parent_end)
        # Across nodes the other ranks take their commands from rank 0.
        self._command_conns = self._conns if engine.nnodes == 1 else self._conns[:1]
        self._failure: str | None = None
        self._pending: deque[_Reply] = deque()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(_Output)
        # Workers stop when the executor is shut down or garbage collected.
        self._finalizer = weakref.finalize(
            self, _stop_workers, self._procs, self._conns, self.options.shutdown_timeout_s
        )
        logger.info(
            "spawned %d workers (tensor parallel size %d, rendezvous %s:%d)",
            local,
            self.world_size,
            engine.master_addr,
            port,
        )

    # ------------------------------------------------------------------ executor API

    def initialize(self) -> KVCacheInfo:
        infos: dict[int, KVCacheInfo] = {}
        while len(infos) < len(self._conns):
            rank, message = self._receive({r for r in range(len(self._conns)) if r not in infos})
            if message[:1] != READY:
                self._fail(f"Worker_TP{rank} sent {message[:1]!r} while starting")
            infos[rank] = msgspec.msgpack.decode(memoryview(message)[1:], type=KVCacheInfo)
        # The ranks agreed on the smallest block count among themselves already.
        first = infos[0]
        return KVCacheInfo(
            num_blocks=min(info.num_blocks for info in infos.values()),
            block_size=first.block_size,
            dtype=first.dtype,
            max_model_len=first.max_model_len,
        )

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[_Output] | _Output:
        message = bytearray(EXECUTE)
        self._encoder.encode_into(scheduler_output, message, 1)
        self._broadcast(message)
        future = _Reply(self)
        self._pending.append(future)
        return future if non_block else future.result()

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        self._resolve_pending(None)  # replies arrive in order: execute's comes first
        message = bytearray(SAMPLE)
        self._encoder.encode_into(grammar_output, message, 1)
        self._broadcast(message)
        output = self._decoder.decode(memoryview(self._receive_reply())[1:])
        if output is None:
            raise RuntimeError("Worker_TP0 sampled nothing: execute_model was not called")
        return output

    def check_health(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                self._fail(_death(rank, proc))

    def shutdown(self) -> None:
        self._finalizer()
        if self._failure is None:
            self._failure = "the mp executor is shut down"

    # ------------------------------------------------------------------ plumbing

    def _broadcast(self, message: bytes | bytearray) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        for rank, conn in enumerate(self._command_conns):
            try:
                conn.send_bytes(message)
            except OSError:  # its end is closed: the worker is gone
                gone = rank
                break
        else:
            return
        self._fail(_death(gone, self._procs[gone]))  # outside the except: no chained noise

    def _resolve_pending(self, timeout: float | None) -> None:
        while self._pending:
            future = self._pending[0]
            try:
                payload = self._receive_reply(timeout)
                future.set_result(self._decoder.decode(memoryview(payload)[1:]))
            except TimeoutError:
                raise
            except BaseException as exc:
                for pending in self._pending:
                    pending.set_exception(exc)
                self._pending.clear()
                raise
            self._pending.popleft()

    def _receive_reply(self, timeout: float | None = None) -> bytes:
        _, message = self._receive({0}, timeout)
        if message[:1] != REPLY:
            self._fail(f"Worker_TP0 sent {message[:1]!r} instead of a reply")
        return message

    def _receive(self, ranks: set[int], timeout: float | None = None) -> tuple[int, bytes]:
        """The next message from one of `ranks`, watching every worker meanwhile: a
        worker's error or death raises RuntimeError naming it."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        watched: list[Any] = [*self._conns, *sentinels]
        while True:
            ready = wait(watched, timeout)
            if not ready:
                raise TimeoutError("no reply from the workers")
            # Messages before deaths: a worker's own error line says more than its exit.
            for rank, conn in enumerate(self._conns):
                if conn not in ready:
                    continue
                try:
                    message = conn.recv_bytes()
                except (EOFError, OSError):
                    message = b""  # its end closed: the worker is gone
                if not message:
                    self._fail(_death(rank, self._procs[rank]))
                if message[:1] == ERROR:
                    error = message[1:].decode(errors="replace")
                    self._fail(f"Worker_TP{rank} failed: {error}", reporter=rank)
                if rank in ranks:
                    return rank, message
                self._fail(f"Worker_TP{rank} sent {message[:1]!r} out of turn")
            for sentinel in ready:
                if sentinel in sentinels:
                    rank = sentinels[sentinel]
                    self._fail(_death(rank, self._procs[rank]))

    def _fail(self, reason: str, reporter: int | None = None) -> NoReturn:
        """Record the first failure, stop every worker and raise. Ranks that died are
        named first: another rank's error (a broken collective) follows from theirs. The
        `reporter`, which exits after sending its error, is not one of them."""
        if self._failure is None:
            dead = [
                _death(rank, proc)
                for rank, proc in enumerate(self._procs)
                if rank != reporter and not proc.is_alive()
            ]
            # dict.fromkeys: the reason may be one of the deaths already listed.
            self._failure = "; ".join(dict.fromkeys([*dead, reason]))
            logger.error("tensor-parallel workers failed: %s", self._failure)
            self._finalizer.detach()
            _stop_workers(self._procs, self._conns, timeout=0.0)
        raise RuntimeError(self._failure)


def _death(rank: int, proc: BaseProcess) -> str:
    proc.join(timeout=1.0)  # EOF can come a moment before the exit status
    code = proc.exitcode
    if code is None:
        how = "closed its pipe"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return f"Worker_TP{rank} (pid {proc.pid}) died unexpectedly: it {how}"


def _stop_workers(procs: list[BaseProcess], conns: list[Connection], timeout: float) -> None:
    """Ask politely, then terminate, then kill; never blocks much past `timeout`."""
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


def _free_port(host: str) -> int:
    # Rank 0 binds it moments later; another process taking it in between would fail
    # the rendezvous loudly, not silently. Set master_port to rule that out.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _spec(config: StackConfig, rank: int, port: int, options: MultiprocOptions) -> WorkerSpec:
    engine = config.engine
    local = engine.tensor_parallel_size // engine.nnodes
    return WorkerSpec(
        config_json=config.model_dump_json(),
        rank=rank,
        local_rank=rank % local,
        world_size=engine.tensor_parallel_size,
        local_world_size=local,
        master_addr=engine.master_addr,
        master_port=port,
        relay=engine.nnodes > 1,
        parent_pid=os.getpid(),
        timeout_s=options.collective_timeout_s,
    )


# --------------------------------------------------------------------------- other nodes


def run_node(config: StackConfig) -> int:
    """Run the ranks of `config.engine.node_rank` (> 0) until they exit; returns the exit
    code (non-zero if any worker failed)."""
    engine = config.engine
    if engine.node_rank == 0 or engine.nnodes == 1:
        raise ValueError("run_node runs the ranks of node 1 and up; node 0 runs the engine")
    assert engine.master_port is not None  # validated for nnodes > 1
    options = MultiprocOptions.model_validate(config.plugin_options("mp") or {})
    local = engine.tensor_parallel_size // engine.nnodes
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(engine.node_rank * local, (engine.node_rank + 1) * local):
        spec = _spec(config, rank, engine.master_port, options)
        proc = ctx.Process(target=worker_main, args=(spec, None), name=spec.name)
        proc.start()
        procs.append(proc)
    failed = 0
    pending = {proc.sentinel: proc for proc in procs}
    while pending:
        for sentinel in wait(list(pending)):
            proc = pending.pop(sentinel)
            proc.join()
            if proc.exitcode:
                failed = 1
                # A rank without its peers can only hang in a collective.
                for other in pending.values():
                    other.kill()
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m plugserve_plugins.executors.mp",
        description="Run this node's tensor-parallel ranks for an engine on node 0.",
    )
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--config", help="stack.yaml (the same settings as node 0)")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    import yaml

    overrides: dict[str, Any] = {"node_rank": args.node_rank}
    for item in args.override:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    config = load_config(args.config, overrides, check_plugins=False)
    configure_process_logging(f"Node{args.node_rank}")
    set_title(f"plugserve::Node{args.node_rank}")
    return run_node(config)


@hookimpl
def register_executors(register):
    register("mp", MultiprocExecutor)


if __name__ == "__main__":
    raise SystemExit(main())
