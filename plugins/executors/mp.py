"""The multi-process executor: one worker process per rank.

The workers (`plugserve::Worker_TP{rank}`, or `Worker_PP{stage}_TP{rank}` under pipeline
parallelism; see mp_worker.py) are spawned children of the engine core and form one
torch.distributed group (gloo on CPU, nccl on CUDA). Each step the SchedulerOutput is
msgpack-encoded once and written to every worker's pipe; rank 0 answers for the group,
since all ranks hold the same persistent batch and rank 0 broadcasts the tokens it
samples.

With pipeline_parallel_size > 1 the executor runs batches concurrently
(capabilities.RunsBatchesConcurrently): each batch is one command to every rank,
`submit_batch` returns at once, and up to one batch per stage is in flight; the last
stage's first rank answers each, in order (datatypes/pipeline_stage.py).

Failure never hangs the engine: every wait watches rank 0's pipe, every worker's pipe
(a worker that raises sends its error line, then exits) and every worker's process
sentinel, so a dead or failing rank surfaces as a RuntimeError naming it at once. The
survivors, possibly stuck in a collective with the dead rank, are then killed.

Across nodes, node 0 runs the engine and this executor (ranks 0..local-1); every other
node runs `python -m plugserve_plugins.executors.mp --node-rank K [--config stack.yaml]
[-o key=value ...]` with the same settings, whose workers take their commands from
rank 0 over the process group (see mp_worker.py). Each other node also sends heartbeats
to this executor (heartbeat.py), watched in the same wait as the local workers, so a
node that dies or goes silent fails the engine within `heartbeat_timeout_s`, not after
the collective timeout.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import msgspec

from plugserve import hookimpl
from plugserve.child_processes import start_child
from plugserve.config import StackConfig, load_config
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
from plugserve.logging_utils import configure_process_logging
from plugserve_plugins.executors.heartbeat import (
    PeerHeartbeats,
    heartbeat_port,
    send_heartbeats,
)
from plugserve_plugins.executors.mp_processes import (
    MultiprocOptions,
    death_reason,
    free_port,
    stop_workers,
    worker_spec,
)
from plugserve_plugins.executors.mp_worker import (
    BATCH,
    COUNTS,
    ERROR,
    EXECUTE,
    READY,
    REPLY,
    SAMPLE,
    set_title,
    worker_main,
)

logger = logging.getLogger(__name__)

# How long a rank's reported error waits for another rank's death to show (its pipe's
# end closing): the error path's only cost where no rank died, cut short by any event.
_DEATH_GRACE_S = 0.5

_Output = ModelRunnerOutput | None


class _Reply(Future):  # type: ignore[type-arg]
    """execute_model's (or submit_batch's) Future: resolved when its result is asked
    for, by reading the output rank's replies up to its own then, so no thread sits
    between the engine and the pipe."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> Any:
        while not self.done():
            self._executor._resolve_next(timeout)
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
        self.tensor_parallel_size = engine.tensor_parallel_size
        self.pipeline_parallel_size = engine.pipeline_parallel_size
        self.world_size = engine.tensor_parallel_size * engine.pipeline_parallel_size
        if self.pipeline_parallel_size > 1 and engine.nnodes > 1:
            raise ValueError(
                "the mp executor runs pipeline stages on one node only (its other nodes "
                "take commands through rank 0, which would wait for the last stage); "
                "use executor 'ray' for stages across nodes"
            )
        self._names = [
            f"Worker_{RankLayout(rank, self.tensor_parallel_size, self.pipeline_parallel_size).name}"
            for rank in range(self.world_size)
        ]
        self._output_rank = output_rank(self.tensor_parallel_size, self.pipeline_parallel_size)
        self._relay = SampledTokenRelay()
        self._staged: SchedulerOutput | None = None
        local = self.world_size // engine.nnodes
        port = engine.master_port or free_port(engine.master_addr)
        self._heartbeats = (
            PeerHeartbeats(
                engine.master_addr,
                heartbeat_port(port),
                {node: f"node {node}" for node in range(1, engine.nnodes)},
                self.options.heartbeat_timeout_s,
            )
            if engine.nnodes > 1
            else None
        )
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        for rank in range(local):
            spec = worker_spec(config, rank, port, self.options)
            parent_end, child_end = multiprocessing.Pipe()
            # daemon: multiprocessing's atexit reaps them if all else fails
            proc = start_child(worker_main, (spec, child_end), name=spec.name, daemon=True)
            child_end.close()  # ours closed, EOF reaches us when the worker dies
            self._procs.append(proc)
            self._conns.append(parent_end)
        # Across nodes the other ranks take their commands from rank 0.
        self._command_conns = self._conns if engine.nnodes == 1 else self._conns[:1]
        self._failure: str | None = None
        self._pending: deque[_Reply] = deque()
        self._counts = MessageCounts()  # the engine's side: batches, commands, replies
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(_Output)
        # Workers stop when the executor is shut down or garbage collected.
        self._finalizer = weakref.finalize(
            self,
            stop_workers,
            self._procs,
            self._conns,
            self.options.shutdown_timeout_s,
            self._heartbeats,
        )
        logger.info(
            "spawned %d workers (tensor parallel size %d, pipeline stages %d, rendezvous %s:%d)",
            local,
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            engine.master_addr,
            port,
        )

    # ------------------------------------------------------------------ executor API

    def initialize(self) -> KVCacheInfo:
        infos: dict[int, KVCacheInfo] = {}
        while len(infos) < len(self._conns):
            rank, message = self._receive({r for r in range(len(self._conns)) if r not in infos})
            if message[:1] != READY:
                self._fail(f"{self._names[rank]} sent {message[:1]!r} while starting")
            infos[rank] = msgspec.msgpack.decode(memoryview(message)[1:], type=KVCacheInfo)
        self._await_nodes()
        # The ranks agreed on the smallest block count among themselves already.
        first = infos[0]
        return KVCacheInfo(
            num_blocks=min(info.num_blocks for info in infos.values()),
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
        """Send one batch through the stages; its Future resolves to the sampled tokens.
        Returns at once: the stages overlap on consecutive batches."""
        command = self._relay.command(scheduler_output, grammar_output)
        message = bytearray(BATCH)
        self._encoder.encode_into(command, message, 1)
        self._counts.batches += 1
        self._broadcast(message)
        future = _Reply(self)
        self._pending.append(future)
        return future

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[_Output] | _Output:
        if self.pipeline_parallel_size > 1:
            # The batch goes out with its bitmask, in sample_tokens.
            self._staged = scheduler_output
            if not non_block:
                return None
            staged: Future[_Output] = Future()
            staged.set_result(None)
            return staged
        message = bytearray(EXECUTE)
        self._encoder.encode_into(scheduler_output, message, 1)
        self._counts.batches += 1
        self._broadcast(message)
        future = _Reply(self)
        self._pending.append(future)
        return future if non_block else future.result()

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        if self.pipeline_parallel_size > 1:
            if self._staged is None:
                raise RuntimeError("sample_tokens without execute_model")
            scheduler_output, self._staged = self._staged, None
            return self.submit_batch(scheduler_output, grammar_output).result()
        self._resolve_pending(None)  # replies arrive in order: execute's comes first
        message = bytearray(SAMPLE)
        self._encoder.encode_into(grammar_output, message, 1)
        self._broadcast(message)
        output = self._decoder.decode(memoryview(self._receive_reply())[1:])
        if output is None:
            raise RuntimeError(f"{self._names[0]} sampled nothing: execute_model was not called")
        return output

    def check_health(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if self._heartbeats is not None:
            gone = self._heartbeats.check(wait(self._heartbeats.waitables(), 0))
            if gone is not None:
                self._fail(gone)
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                self._fail(self._death(rank))

    def message_counts(self) -> MessageCounts:
        """capabilities.CountsMessages: the engine's side and every local rank's."""
        self._resolve_pending(None)  # the batches in flight keep their results for the engine
        self._broadcast(COUNTS, counted=False)
        counts = self._counts + MessageCounts()
        # Every local rank answers, whether the command reached it by pipe or by relay.
        waiting = set(range(len(self._conns)))
        while waiting:
            rank, message = self._receive(waiting)
            if message[:1] != COUNTS:
                self._fail(f"{self._names[rank]} sent {message[:1]!r} instead of its counts")
            counts += msgspec.msgpack.decode(memoryview(message)[1:], type=MessageCounts)
            waiting.discard(rank)
        return counts

    def shutdown(self) -> None:
        self._finalizer()
        if self._failure is None:
            self._failure = "the mp executor is shut down"

    # ------------------------------------------------------------------ plumbing

    def _broadcast(self, message: bytes | bytearray, counted: bool = True) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if counted:
            self._counts.commands += len(self._command_conns)
            self._counts.command_bytes += len(message) * len(self._command_conns)
        for rank, conn in enumerate(self._command_conns):
            try:
                conn.send_bytes(message)
            except OSError:  # its end is closed: the worker is gone
                gone = rank
                break
        else:
            return
        self._fail(self._death(gone))  # outside the except: no chained noise

    def _resolve_pending(self, timeout: float | None) -> None:
        while self._pending:
            self._resolve_next(timeout)

    def _resolve_next(self, timeout: float | None) -> None:
        """Read the oldest pending reply (replies come back in the order sent)."""
        future = self._pending[0]
        try:
            payload = self._receive_reply(timeout)
            output = self._decoder.decode(memoryview(payload)[1:])
        except TimeoutError:
            raise
        except BaseException as exc:
            for pending in self._pending:
                pending.set_exception(exc)
            self._pending.clear()
            raise
        self._pending.popleft()
        if self.pipeline_parallel_size > 1 and output is not None:
            self._relay.record(output)
        future.set_result(output)

    def _receive_reply(self, timeout: float | None = None) -> bytes:
        _, message = self._receive({self._output_rank}, timeout)
        if message[:1] != REPLY:
            name = self._names[self._output_rank]
            self._fail(f"{name} sent {message[:1]!r} instead of a reply")
        self._counts.replies += 1
        self._counts.reply_bytes += len(message)
        return message

    def _receive(self, ranks: set[int], timeout: float | None = None) -> tuple[int, bytes]:
        """The next message from one of `ranks`, watching every worker meanwhile: a
        worker's error or death raises RuntimeError naming it."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        heartbeats = self._heartbeats
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            watched: list[Any] = [*self._conns, *sentinels]
            wake = give_up
            if heartbeats is not None:
                watched += heartbeats.waitables()
                overdue = heartbeats.next_deadline()
                if overdue is not None:
                    wake = overdue if wake is None else min(wake, overdue)
            ready = wait(watched, None if wake is None else max(0.0, wake - time.monotonic()))
            if heartbeats is not None:
                gone = heartbeats.check(ready)
                if gone is not None:
                    self._fail(gone)
            if give_up is not None and not ready and time.monotonic() >= give_up:
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
                    self._fail(self._death(rank))
                if message[:1] == ERROR:
                    error = message[1:].decode(errors="replace")
                    self._fail(f"{self._names[rank]} failed: {error}", reporter=rank)
                if rank in ranks:
                    return rank, message
                self._fail(f"{self._names[rank]} sent {message[:1]!r} out of turn")
            for sentinel in ready:
                if sentinel in sentinels:
                    self._fail(self._death(sentinels[sentinel]))

    def _fail(self, reason: str, reporter: int | None = None) -> NoReturn:
        """Record the first failure, stop every worker and raise. Ranks that died are
        named first: another rank's error (a broken collective) follows from theirs. The
        `reporter`, which exits after sending its error, is not one of them."""
        if self._failure is None:
            dead = [self._death(rank) for rank in self._gone_ranks(reporter)]
            # dict.fromkeys: the reason may be one of the deaths already listed.
            self._failure = "; ".join(dict.fromkeys([*dead, reason]))
            logger.error("workers failed: %s", self._failure)
            self._finalizer.detach()
            stop_workers(self._procs, self._conns, 0.0, self._heartbeats)
        raise RuntimeError(self._failure)

    def _gone_ranks(self, reporter: int | None) -> list[int]:
        """The local ranks other than `reporter` that died without reporting an error. A
        rank killed by a signal closes its files (this pipe's end and its collective's
        sockets alike) before its exit status exists, so the rank whose collective broke
        can report first: a closed pipe counts as a death, and a reporter's error waits a
        moment for one to show. A rank that sent its own error (the same bad step, or a
        collective broken by the reporter's exit) is a consequence, not a death."""
        others = [rank for rank in range(len(self._procs)) if rank != reporter]
        if reporter is not None:
            watched = [self._conns[r] for r in others] + [self._procs[r].sentinel for r in others]
            wait(watched, _DEATH_GRACE_S)
        return [rank for rank in others if self._died_silently(rank)]

    def _died_silently(self, rank: int) -> bool:
        """Whether rank is gone (exited, or its end of the pipe closed) with no error
        message of its own; what waits in its pipe is read and dropped, as the engine is
        failing."""
        conn = self._conns[rank]
        reported = closed = False
        try:
            while conn.poll(0):
                reported |= conn.recv_bytes()[:1] == ERROR
        except (EOFError, OSError):
            closed = True
        return not reported and (closed or not self._procs[rank].is_alive())

    def _await_nodes(self) -> None:
        """Once the ranks are up, every other node has dialled in its heartbeats (its
        ranks joined the rendezvous, so it is running): wait for the last ones."""
        heartbeats = self._heartbeats
        if heartbeats is None:
            return
        give_up = time.monotonic() + self.options.collective_timeout_s
        while not heartbeats.all_joined:
            left = give_up - time.monotonic()
            if left <= 0:
                self._fail("a node's ranks joined, but its heartbeats never reached node 0")
            gone = heartbeats.check(wait(heartbeats.waitables(), min(left, 0.1)))
            if gone is not None:
                self._fail(gone)
        heartbeats.watch_silence()

    def _death(self, rank: int) -> str:
        return death_reason(self._names[rank], self._procs[rank])


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
    procs = []
    for rank in range(engine.node_rank * local, (engine.node_rank + 1) * local):
        spec = worker_spec(config, rank, engine.master_port, options)
        proc = start_child(worker_main, (spec, None), name=spec.name)
        procs.append(proc)
    stop_beating = threading.Event()
    send_heartbeats(
        engine.master_addr,
        heartbeat_port(engine.master_port),
        engine.node_rank,
        options.heartbeat_interval_s,
        stop_beating,
    )
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
                # Node 0 learns of it from the heartbeats' end.
                stop_beating.set()
    stop_beating.set()
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
