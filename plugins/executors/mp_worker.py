"""The worker process of the `mp` executor: one per rank (tensor-parallel rank of a
pipeline stage).

A worker builds a ModelRunner for its rank, joins the torch.distributed group, says it
is ready with its KV capacity, then serves commands until told to stop:

    executor → worker   b"E" + msgpack(SchedulerOutput)   execute_model
                        b"S" + msgpack(grammar output)    sample_tokens
                        b"B" + msgpack(StageCommand)      one batch through the stages
                        b"C"                              message counts (between batches)
                        b"Q"                              shut down
    worker → executor   b"I" + msgpack(KVCacheInfo)       ready (every rank)
                        b"R" + msgpack(output or None)    a reply (the output rank only)
                        b"C" + msgpack(MessageCounts)     this rank's counts (every rank)
                        b"X" + utf-8 error line           failed; the worker exits

The output rank is rank 0 without pipeline parallelism, else the last stage's first
rank, which samples (worker/pipeline.py). Under pipeline parallelism every batch is one
b"B" command, answered when the last stage has sampled it; the earlier stages go on to
the next command as soon as they have sent their activations on.

Commands arrive on the worker's Pipe from the executor. Across nodes (nnodes > 1) only
rank 0 has the executor's commands; it relays each one to every rank with a broadcast
over a gloo group, so remote ranks need nothing but the rendezvous.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from plugserve.config import StackConfig
from plugserve.datatypes import GrammarOutput, RankLayout, SchedulerOutput, StageCommand
from plugserve.logging_utils import configure_process_logging
from plugserve.process_exit import exit_now

logger = logging.getLogger(__name__)

EXECUTE, SAMPLE, BATCH, COUNTS, SHUTDOWN = b"E", b"S", b"B", b"C", b"Q"
READY, REPLY, ERROR = b"I", b"R", b"X"

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, picklable for the spawn context."""

    config_json: str
    rank: int
    local_rank: int
    world_size: int  # tensor_parallel_size x pipeline_parallel_size
    tensor_parallel_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    relay: bool  # commands reach ranks > 0 through rank 0's broadcast (multi-node)
    parent_pid: int
    timeout_s: float

    @property
    def layout(self) -> RankLayout:
        tp = self.tensor_parallel_size
        return RankLayout(self.rank, tp, self.world_size // tp)

    @property
    def name(self) -> str:
        return f"Worker_{self.layout.name}"


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when the engine goes, so an engine that is killed never
    leaves workers behind. We are forked by the engine's fork server
    (plugserve.child_processes), which exits when the engine does: the signal follows
    that process."""
    forked_by = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The engine, or the fork server, may have gone before prctl took effect.
    if os.getppid() != forked_by or not _alive(parent_pid):
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # the title is a convenience for ps and top
        pass


def worker_main(spec: WorkerSpec, conn: Connection | None) -> None:
    """Entry point of a spawned worker. `conn` is None on a remote node (relay mode)."""
    die_with_parent(spec.parent_pid)
    set_title(f"plugserve::{spec.name}")
    configure_process_logging(spec.name)
    # The engine decides when workers stop; a terminal's Ctrl-C must not kill one mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        _run(spec, conn)
        _destroy_group()
    except BaseException as exc:
        logger.exception("worker failed")
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send_bytes(ERROR + one_line(exc).encode())
        code = 1
    exit_now(code)


def _run(spec: WorkerSpec, conn: Connection | None) -> None:
    import torch

    from plugserve.device import resolve_device
    from plugserve.worker.model_runner import ModelRunner
    from plugserve.worker.parallel import init_parallel, join_groups, rank_message_counts
    from plugserve.worker.pipeline import run_stage_command

    config = StackConfig.model_validate_json(spec.config_json)
    if config.engine.num_threads is None:
        # The ranks of a node share its cores; more threads than cores only thrash.
        config.engine.num_threads = max(1, (os.cpu_count() or 1) // spec.local_world_size)
    device = resolve_device(config.engine.device)
    layout = spec.layout
    parallel = placement = None
    control: Any = None
    if spec.world_size > 1:
        init_parallel(
            rank=spec.rank,
            world_size=spec.world_size,
            local_rank=spec.local_rank,
            master_addr=spec.master_addr,
            master_port=spec.master_port,
            device=device,
            timeout_s=spec.timeout_s,
        )
        parallel, placement = join_groups(layout, config.engine.pp_layer_partition)
        if spec.relay and device.type == "cuda":
            # nccl moves device tensors only; commands are host bytes.
            import torch.distributed as dist

            control = dist.new_group(backend="gloo")
    runner = ModelRunner(config, parallel, placement)
    info = runner.initialize()
    logger.info("rank %d of %d ready (%d KV blocks)", spec.rank, spec.world_size, info.num_blocks)
    if conn is not None:
        conn.send_bytes(READY + msgspec.msgpack.encode(info))
    commands = _Commands(spec, conn, control)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    grammar_decoder = msgspec.msgpack.Decoder(GrammarOutput | None)
    batch_decoder = msgspec.msgpack.Decoder(StageCommand)
    answers = layout.is_output_rank and conn is not None
    with torch.inference_mode():
        while True:
            message = commands.next()
            kind = message[:1]
            if kind == EXECUTE:
                out = runner.execute_model(decoder.decode(memoryview(message)[1:]))
            elif kind == SAMPLE:
                grammar = grammar_decoder.decode(memoryview(message)[1:])
                out = runner.sample_tokens(grammar)
            elif kind == BATCH:
                out = run_stage_command(runner, batch_decoder.decode(memoryview(message)[1:]))
            elif kind == COUNTS:
                if conn is not None:  # the ranks of other nodes count for themselves
                    conn.send_bytes(COUNTS + encoder.encode(rank_message_counts()))
                continue
            elif kind == SHUTDOWN:
                logger.info("shutting down")
                return
            else:
                raise RuntimeError(f"unknown command {kind!r}")
            if answers:  # the output rank answers for the group
                conn.send_bytes(REPLY + encoder.encode(out))


class _Commands:
    """Where a rank's commands come from: its pipe, or rank 0's broadcast."""

    def __init__(self, spec: WorkerSpec, conn: Connection | None, group: Any) -> None:
        self.rank = spec.rank
        self.relay = spec.relay and spec.world_size > 1
        self.conn = conn
        self.group = group

    def next(self) -> bytes:
        if self.relay and self.rank != 0:
            return broadcast_bytes(None, self.group)
        assert self.conn is not None
        try:
            message = self.conn.recv_bytes()
        except (EOFError, OSError):
            # The engine went away without a goodbye: stop, and take the others along.
            message = SHUTDOWN
        if self.relay:
            broadcast_bytes(message, self.group)
        return message


def broadcast_bytes(data: bytes | None, group: Any) -> bytes:
    """Rank 0's `data` on every rank of `group` (two gloo broadcasts: length, payload)."""
    import torch
    import torch.distributed as dist

    from plugserve.worker.parallel import count_collective

    size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
    count_collective(size)
    dist.broadcast(size, src=0, group=group)
    if data is None:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    else:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    count_collective(buffer)
    dist.broadcast(buffer, src=0, group=group)
    return buffer.numpy().tobytes()


def _destroy_group() -> None:
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
