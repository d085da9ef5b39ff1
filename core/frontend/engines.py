"""Who starts, watches and stops the engine-core processes, as an API server sees it.

With one API server, that server starts the engines itself (`SpawnedEngines`), forked
from it before it runs a second thread, and watches their process sentinels. With
several, the launcher starts them (`EngineProcesses`, used synchronously) and tells
every API server over its control pipe when one exits (`LauncherEngines`); an API
server cannot watch a sibling's children itself. Either way the client learns "engine i
is gone, because ..." through one callback, once per engine: with data parallelism the
others may go on serving. A client that owns no engines never shuts them down.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from plugserve.child_processes import start_child
from plugserve.config import StackConfig

# The engine's target's light module: engine_proc (the engine, the model runner) is
# imported by the engine process itself, never by an API server.
from plugserve.engine.entrypoint import engine_process_name, run_engine_core
from plugserve.ops.process_env import apply_malloc_environment
from plugserve.plugins import get_registry

ENGINE_STOP_TIMEOUT_S = 5.0  # per step: asked (SHUTDOWN or SIGTERM), terminated, killed
# Control message, launcher → API server: (ENGINE_GONE, (engine index, reason)).
ENGINE_GONE = "engine-gone"

# on_gone(engine index, reason): that engine is unusable.
OnEngineGone = Callable[[int, str], None]


def transport_addresses(config: StackConfig) -> dict[str, str]:
    """Fresh addresses joining every engine to every API server of this config."""
    registry = get_registry(config.disabled_plugins)
    stack = config.stack
    transport = registry.build("transport", stack.transport, config.plugin_options(stack.transport))
    return transport.addresses(config.engine.data_parallel_size, config.server.api_server_count)


class EngineProcesses:
    """The engine-core processes of one server, one per data-parallel rank."""

    def __init__(self, config: StackConfig, addresses: dict[str, str]) -> None:
        self.config = config
        self.addresses = addresses
        self.num_engines = config.engine.data_parallel_size
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._go: list[multiprocessing.connection.Connection] = []

    def prefork(self) -> None:
        """Fork the engines now, each waiting until `start`: they find torch and the
        plugins this process has imported already imported, where a child of the fork
        server would import them again. Only while this process runs a single thread (a
        fork copies no other thread, and any lock one held stays held in the child);
        otherwise `start` starts them from the fork server. Not once this process has
        made a CUDA context either: a forked child cannot use its parent's. Linux only
        (macOS's system libraries are not safe to fork without an exec)."""
        if (
            not sys.platform.startswith("linux")
            or threading.active_count() > 1
            or self.processes
            or _cuda_initialized()
        ):
            return
        context = multiprocessing.get_context("fork")
        config_json = self.config.model_dump_json()
        for index in range(self.num_engines):
            waiting, go = context.Pipe(duplex=False)
            process = context.Process(
                target=_run_engine_core_when_started,
                args=(waiting, [*self._go, go], config_json, self.addresses, index),
                name=engine_process_name(index, self.num_engines),
            )
            process.start()
            waiting.close()
            self.processes.append(process)
            self._go.append(go)
        # Before multiprocessing's own exit handler joins them: an exit that never
        # started them must let them go first.
        atexit.register(self._release_unstarted)

    def _release_unstarted(self) -> None:
        for go in self._go:
            go.close()
        self._go = []

    def start(self) -> None:
        if self._go:
            for go in self._go:
                # One that died waiting is reported by its sentinel, as any engine's death.
                with contextlib.suppress(BrokenPipeError):
                    go.send_bytes(b"go")
                go.close()
            self._go = []
            return
        config_json = self.config.model_dump_json()
        for index in range(self.num_engines):
            process = start_child(
                run_engine_core,
                (config_json, self.addresses, index),
                name=engine_process_name(index, self.num_engines),
            )
            self.processes.append(process)

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.processes]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def exited(self) -> dict[int, str]:
        """Why each engine that has exited is unusable, by engine index."""
        return {
            index: exit_reason(engine_process_name(index, self.num_engines), process.exitcode)
            for index, process in enumerate(self.processes)
            if process.exitcode is not None
        }

    def stop(self, asked: bool) -> None:
        """Stop every engine, blocking: give those `asked` to shut down (a SHUTDOWN
        message sent) time to do so, then SIGTERM (which an engine also treats as a
        shutdown), then SIGKILL."""
        steps: list[str | None] = [None] if asked else []
        for step in [*steps, "terminate", "kill"]:
            alive = [p for p in self.processes if p.is_alive()]
            if not alive:
                return
            if step is not None:
                for process in alive:
                    getattr(process, step)()
            join_all(alive, ENGINE_STOP_TIMEOUT_S)


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def _run_engine_core_when_started(
    waiting: multiprocessing.connection.Connection,
    senders: list[multiprocessing.connection.Connection],
    config_json: str,
    addresses: dict[str, str],
    engine_index: int,
) -> None:
    """A forked engine: it waits for `start`, then runs. Its parent gone first (the pipe
    closed unsent) means nobody will ever start it. The sending ends it was forked with
    (its own, and those of the engines forked before it) are its parent's alone."""
    for sender in senders:
        sender.close()
    try:
        waiting.recv_bytes()
    except EOFError:
        os._exit(0)
    waiting.close()
    apply_malloc_environment()
    run_engine_core(config_json, addresses, engine_index)


def exit_reason(name: str, exit_code: int) -> str:
    return f"the engine core {name} exited unexpectedly (exit code {exit_code})"


def join_all(processes: list[multiprocessing.process.BaseProcess], timeout: float) -> None:
    """Join every process, `timeout` seconds at most in all."""
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


class EngineSupervision(Protocol):
    """How an API server's client starts, watches and stops its engines."""

    owns_engines: bool  # True: the client tells the engines to shut down when it does

    def start(self) -> None: ...

    def watch(self, on_gone: OnEngineGone) -> None:
        """Call `on_gone(index, reason)` (in the running loop) once for each engine that
        becomes unusable."""
        ...

    async def stop(self, asked: bool) -> None: ...


class SpawnedEngines:
    """The engines of the only API server, started by it and watched by their sentinels."""

    owns_engines = True

    def __init__(self, config: StackConfig, addresses: dict[str, str]) -> None:
        self.processes = EngineProcesses(config, addresses)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched: set[int] = set()

    def prefork(self) -> None:
        self.processes.prefork()

    def start(self) -> None:
        self.processes.start()

    def watch(self, on_gone: OnEngineGone) -> None:
        self._loop = asyncio.get_running_loop()
        self._watched = set(range(self.processes.num_engines))

        def exited(index: int) -> None:
            reason = self.processes.exited().get(index)
            if reason is not None and index in self._watched:
                self._unwatch(index)
                on_gone(index, reason)

        for index, sentinel in enumerate(self.processes.sentinels):
            self._loop.add_reader(sentinel, exited, index)

    def _unwatch(self, *indexes: int) -> None:
        if self._loop is None:
            return
        sentinels = self.processes.sentinels
        for index in indexes or sorted(self._watched):
            self._watched.discard(index)
            self._loop.remove_reader(sentinels[index])

    async def stop(self, asked: bool) -> None:
        self._unwatch()
        await asyncio.get_running_loop().run_in_executor(None, self.processes.stop, asked)


class LauncherEngines:
    """Engines that the launcher owns: it sends (ENGINE_GONE, (index, reason)) over this
    API server's control pipe when one exits. The pipe closing means the launcher is
    gone, which leaves this API server nothing to serve with either."""

    owns_engines = False

    def __init__(self, control: multiprocessing.connection.Connection, num_engines: int) -> None:
        self.control = control
        self.num_engines = num_engines
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Nothing to start: the launcher started the engines."""

    def watch(self, on_gone: OnEngineGone) -> None:
        self._loop = asyncio.get_running_loop()

        def readable() -> None:
            try:
                kind, payload = self.control.recv()
            except (EOFError, OSError):
                self._unwatch()
                for index in range(self.num_engines):
                    on_gone(index, "the launcher is gone")
                return
            if kind == ENGINE_GONE:
                index, reason = payload
                on_gone(index, reason)

        self._loop.add_reader(self.control.fileno(), readable)

    def _unwatch(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.control.fileno())
            self._loop = None

    async def stop(self, asked: bool) -> None:
        self._unwatch()
