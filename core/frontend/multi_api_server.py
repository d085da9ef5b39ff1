"""Several API servers on one port (`server.api_server_count: N > 1`), as vLLM's
`--api-server-count`: what the launcher process runs, and the entry point of each API
server it spawns.

The launcher (plugserve::Launcher, the process `plugserve serve` started) binds the
listening socket(s), spawns N API-server processes (plugserve::ApiServer_0 …
ApiServer_{N-1}) and the engine cores, and then only supervises: every API server has its
own transport channel to every engine (client number i), and a control pipe to the
launcher. Failures are the server's failures:

- an engine exits: the launcher tells every API server, which fail its in-flight
  requests with 503; with data parallelism they serve on with the other engines, and
  once none is left (always, with one) they exit 1 and the launcher stops the rest
  and exits 1;
- an API server exits without being asked: the launcher stops everything and exits 1,
  rather than leave a server that answers only some connections;
- SIGINT or SIGTERM: the API servers get SIGTERM (uvicorn's graceful shutdown), then the
  engines (which treat it as a SHUTDOWN); exit 0. A second SIGINT kills everything;
- the launcher is killed: engines exit with their parent, API servers when their
  control pipe closes.

On Linux each API server gets a listening socket of its own, all bound to the same port
with SO_REUSEPORT, so that the kernel spreads new connections evenly over them; elsewhere
they share one socket (and whichever process accepts first takes the connection).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType

from plugserve.child_processes import start_child
from plugserve.config import StackConfig
from plugserve.frontend.api_server_process import (
    ApiServerSetup,
    http_url,
    name_process,
    run_api_server_loop,
)
from plugserve.frontend.engines import (
    ENGINE_GONE,
    EngineProcesses,
    LauncherEngines,
    join_all,
    transport_addresses,
)
from plugserve.frontend.metrics import (
    multiprocess_directory,
    remove_orphaned_multiprocess_directory,
)
from plugserve.model_files import resolve_model_path
from plugserve.process_exit import exit_now

logger = logging.getLogger(__name__)

LAUNCHER_NAME = "Launcher"
SERVING = "serving"  # control message, API server → launcher: (SERVING, None)
# An asked API server drains for at most server.shutdown_timeout, then has uvicorn's
# close and its client's shutdown: this long beyond the drain before it is killed.
API_SERVER_STOP_TIMEOUT_S = 15.0
LISTEN_BACKLOG = 2048  # uvicorn's default


def api_server_name(index: int) -> str:
    return f"ApiServer_{index}"


def serve_with_api_servers(config: StackConfig) -> int:
    """`plugserve serve` with several API servers; the exit code."""
    name_process(LAUNCHER_NAME)
    resolve_model_path(config.model)  # a GGUF is converted once, before the children start
    host, port = config.server.host, config.server.port
    try:
        sockets = listening_sockets(host, port, config.server.api_server_count)
    except OSError as exc:
        logger.error("cannot listen on %s: %s", http_url(host, port), exc.strerror or exc)
        return 1
    config = config.model_copy(deep=True)
    config.server.port = sockets[0][0].getsockname()[1]  # port 0 picks one: the same for all
    # /metrics sums every API server's figures through prometheus-client's multiprocess
    # mode (frontend/metrics.py): their directory, made before they are spawned.
    with multiprocess_directory() as metrics_dir:
        logger.info("the API servers' metrics are summed through %s", metrics_dir)
        return Launcher(config, sockets).run()


def listening_sockets(host: str, port: int, count: int) -> list[list[socket.socket]]:
    """For each of `count` API servers, its listening sockets on host:port (one per
    address `host` resolves to, as uvicorn binds them): on Linux distinct SO_REUSEPORT
    sockets per API server (the kernel balances connections over them), elsewhere the
    same sockets for all. Raises OSError if the port is taken."""
    resolved = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = list(dict.fromkeys((family, address) for family, _, _, _, address in resolved))
    balanced = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
    opened: list[socket.socket] = []
    per_server: list[list[socket.socket]] = []
    try:
        for _ in range(count if balanced else 1):
            sockets = []
            for family, address in addresses:
                sock = socket.socket(family, socket.SOCK_STREAM)
                opened.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if balanced:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6 and len(addresses) > 1:
                    # "::" would take IPv4 too and clash with the IPv4 socket.
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((*address[:1], port, *address[2:]))
                sock.listen(LISTEN_BACKLOG)
                port = sock.getsockname()[1]  # with port 0, the rest join the port picked
                sockets.append(sock)
            per_server.append(sockets)
    except BaseException:
        for sock in opened:
            sock.close()
        raise
    return per_server if balanced else per_server * count


def run_api_server_process(
    config_json: str,
    addresses: dict[str, str],
    index: int,
    sockets: list[socket.socket],
    control: Connection,
) -> None:
    """Entry point of API-server process number `index` (client `index` of the engines)."""
    config = StackConfig.model_validate_json(config_json)
    name = api_server_name(index)
    name_process(name)
    # A terminal's Ctrl-C reaches the whole process group; the launcher answers it by
    # stopping the API servers with SIGTERM, in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup = ApiServerSetup(
        name=name,
        client_index=index,
        addresses=addresses,
        engines=LauncherEngines(control, config.engine.data_parallel_size),
        sockets=sockets,
        stop_signals=(signal.SIGTERM,),
        on_serving=lambda: control.send((SERVING, None)),
    )
    exit_code = run_api_server_loop(config, setup)
    remove_orphaned_multiprocess_directory()
    exit_now(exit_code)


class Launcher:
    """Starts the API servers and engines, watches them, stops them in order."""

    def __init__(self, config: StackConfig, sockets: list[list[socket.socket]]) -> None:
        self.config = config
        self.count = config.server.api_server_count
        self.sockets = sockets
        self.addresses = transport_addresses(config)
        self.engines = EngineProcesses(config, self.addresses)
        self.api_servers: list[BaseProcess] = []
        self.controls: list[Connection] = []
        self._serving: set[int] = set()
        self._engine_failed = False  # the API servers were told, and exit by themselves
        self._signals: list[int] = []
        self._wakeup_read, self._wakeup_write = os.pipe()

    def run(self) -> int:
        with self._stop_signals():
            try:
                self._start()
                failure = self._supervise()
            finally:
                self._stop()
        if failure is not None:
            logger.error("%s; stopped everything", failure)
            return 1
        logger.info("stopped")
        return 0

    # ------------------------------------------------------------------ start

    def _start(self) -> None:
        # API servers first: each opens its channel (for shm: creates its rings) while
        # the engines load.
        config_json = self.config.model_dump_json()
        for index in range(self.count):
            ours, theirs = multiprocessing.Pipe()
            process = start_child(
                run_api_server_process,
                (config_json, self.addresses, index, self.sockets[index], theirs),
                name=api_server_name(index),
            )
            theirs.close()  # the child has its copy; EOF on ours then means it is gone
            self.api_servers.append(process)
            self.controls.append(ours)
        for sock in {sock for sockets in self.sockets for sock in sockets}:
            sock.close()  # the API servers hold them now
        self.engines.start()
        logger.info(
            "started %d API servers (pids %s) and %d engine core(s) (pids %s)",
            self.count,
            ", ".join(str(p.pid) for p in self.api_servers),
            self.engines.num_engines,
            ", ".join(map(str, self.engines.pids)),
        )

    # ------------------------------------------------------------------ supervise

    def _supervise(self) -> str | None:
        """Watch until a stop signal (None) or a failure (what failed)."""
        open_controls = list(self.controls)
        told: set[int] = set()  # the engines the API servers know to be gone
        last_gone = ""
        while True:
            live_engines = [
                sentinel
                for index, sentinel in enumerate(self.engines.sentinels)
                if index not in told
            ]
            watched = [
                self._wakeup_read,
                *live_engines,
                *(p.sentinel for p in self.api_servers),
                *open_controls,
            ]
            ready = multiprocessing.connection.wait(watched)
            if self._signals:
                logger.info("%s: stopping", signal.Signals(self._signals[0]).name)
                return None
            for index, reason in self.engines.exited().items():
                if index not in told:
                    told.add(index)
                    last_gone = reason
                    if len(told) < self.engines.num_engines:
                        logger.error("%s: the other engines serve on", reason)
                    self._tell_api_servers(index, reason)
            if len(told) == self.engines.num_engines:
                # With data parallelism the others served on until now.
                self._engine_failed = True
                return last_gone
            for index, process in enumerate(self.api_servers):
                if process.exitcode is not None:
                    name = api_server_name(index)
                    return (
                        f"the API server {name} exited unexpectedly (exit code {process.exitcode})"
                    )
            for control in [c for c in open_controls if c in ready]:
                if not self._read_control(control):
                    open_controls.remove(control)  # its process is exiting: the sentinel tells

    def _read_control(self, control: Connection) -> bool:
        """Take one message from an API server; False once its pipe is closed."""
        try:
            kind, _ = control.recv()
        except (EOFError, OSError):
            return False
        if kind == SERVING:
            self._serving.add(self.controls.index(control))
            if len(self._serving) == self.count:
                url = http_url(self.config.server.host, self.config.server.port)
                logger.info(
                    "serving %s with %d API servers: running on %s",
                    self.config.server.served_model_name or self.config.model,
                    self.count,
                    url,
                )
        return True

    def _tell_api_servers(self, engine: int, reason: str) -> None:
        for control in self.controls:
            with contextlib.suppress(OSError):  # that API server is gone already
                control.send((ENGINE_GONE, (engine, reason)))

    # ------------------------------------------------------------------ stop

    def _stop(self) -> None:
        """API servers first (so none takes a request the engines can no longer serve
        to the end), then the engines. API servers told of a dead engine exit by
        themselves once their in-flight requests have failed."""
        if self._engine_failed:
            join_all(self.api_servers, API_SERVER_STOP_TIMEOUT_S)
        drain = self.config.server.shutdown_timeout
        for step, timeout in (("terminate", drain + API_SERVER_STOP_TIMEOUT_S), ("kill", 5.0)):
            alive = [p for p in self.api_servers if p.is_alive()]
            for process in alive:
                getattr(process, step)()
            join_all(alive, timeout)
        self.engines.stop(asked=False)
        for control in self.controls:
            control.close()

    @contextlib.contextmanager
    def _stop_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM wake `_supervise` through a pipe; a second SIGINT kills
        every child at once and exits."""

        def handle(sig: int, _frame: FrameType | None) -> None:
            self._signals.append(sig)
            if sig == signal.SIGINT and self._signals.count(signal.SIGINT) > 1:
                self._kill_everything()
            with contextlib.suppress(BlockingIOError):
                os.write(self._wakeup_write, b"\0")

        os.set_blocking(self._wakeup_write, False)
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, handle) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(self._wakeup_read)
            os.close(self._wakeup_write)

    def _kill_everything(self) -> None:
        for process in [*self.api_servers, *self.engines.processes]:
            if process.pid is not None and process.exitcode is None:
                with contextlib.suppress(OSError):
                    os.kill(process.pid, signal.SIGKILL)
        logger.error("second SIGINT: killed every process")
        os._exit(1)
