"""A server in a child process, as the tests and the benchmarks run one: launched on a
port with its own environment and a log file, waited on until it answers healthy,
stopped with a signal and checked on the way out.

The server runs in a process group of its own, so that stopping it can see, and end,
every process it started, whoever started them: a server that ignores its stop signal
or leaves a process behind is reported, never left running. Every wait is bounded.

plugserve_server.PlugserveServer is the one for `plugserve serve`; a peer's server (vLLM,
llama-server) is this class around its launch script.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from plugserve.bench.processes import live_group_members, process_cmdline

STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
# After the server exits, how long the processes it started get to follow it.
FOLLOW_TIMEOUT_S = 10.0


Server = TypeVar("Server", bound="ServerProcess")


class ServerError(RuntimeError):
    """The server exited before it was healthy, never became healthy, or did not stop
    cleanly; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Poll `predicate` until it returns something truthy; return that, or the last
    (falsy) value once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


@dataclass(frozen=True)
class ExitReport:
    """How a server ended when it was stopped."""

    returncode: int
    # It was still running `timeout` seconds after the stop signal, and was killed.
    ignored_stop_signal: bool
    # "pid command line" of each process of its group that outlived it (then killed).
    outlived: tuple[str, ...]
    # It had already exited when it was asked to stop.
    exited_before_stop: bool

    def problems(self, *, expect_success: bool) -> list[str]:
        """What went wrong; with `expect_success`, a server that was still running when it
        was asked to stop must also have exited 0."""
        found = []
        if self.ignored_stop_signal:
            found.append("it did not exit on its stop signal and was killed")
        if self.outlived:
            found.append("processes outlived it: " + "; ".join(self.outlived))
        if expect_success and not self.exited_before_stop and self.returncode != 0:
            found.append(f"it exited with {self.returncode} when stopped")
        return found


class ServerProcess:
    """One server command in a child process, its output in `log_path`.

    Constructing it starts nothing: `launch()` starts the process and returns at once,
    so a caller can start the next server while it still uses the current one;
    `wait_healthy()` then waits for it, and `running()` does all three with the stop.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        ready_line: str | None = None,
        stop_signal: signal.Signals = signal.SIGTERM,
        poll_interval: float = 0.25,
        follow_timeout: float = FOLLOW_TIMEOUT_S,
    ) -> None:
        """`env` is added to this process's environment. `ready_line`: text the log must
        show before /health is asked, so that another server that took the port cannot
        pass for this one."""
        self.command = list(command)
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.added_env = dict(env or {})
        self.env = {**os.environ, **self.added_env}
        self.cwd = cwd
        self.ready_line = ready_line
        self.stop_signal = stop_signal
        self.poll_interval = poll_interval
        self.follow_timeout = follow_timeout
        self._popen: subprocess.Popen[bytes] | None = None
        self._launched_at = 0.0
        # Seconds from the launch to the first healthy answer, once there was one.
        self.healthy_after: float | None = None

    # ------------------------------------------------------------------ life cycle

    def launch(self: Server) -> Server:
        """Start the process (once) and return without waiting for it."""
        if self._popen is None:
            with open(self.log_path, "wb") as log:
                self._popen = subprocess.Popen(
                    self.command,
                    cwd=self.cwd,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self._launched_at = time.monotonic()
        return self

    @property
    def launched(self) -> bool:
        return self._popen is not None

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        if self._popen is None:
            raise RuntimeError("the server has not been launched")
        return self._popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> float:
        """Wait until GET /health answers 200 (launching the server if need be); returns
        the seconds from the launch to the first healthy answer. Raises ServerError if the
        process exits first or `timeout` passes."""
        self.launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise ServerError(
                    f"the server exited with {self.popen.returncode} before it was healthy:\n"
                    + self.log_tail()
                )
            if self._answers_health():
                if self.healthy_after is None:
                    self.healthy_after = time.monotonic() - self._launched_at
                return self.healthy_after
            time.sleep(self.poll_interval)
        raise ServerError(f"the server was not healthy within {timeout:.0f} s:\n" + self.log_tail())

    def _answers_health(self) -> bool:
        if self.ready_line is not None and self.ready_line not in self.log_text():
            return False
        try:
            return httpx.get(self.url("/health"), timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> ExitReport:
        """Send the stop signal, wait up to `timeout` s for the exit (then kill it), and
        give the processes it started `follow_timeout` s to follow it before they are
        killed."""
        popen = self.popen
        exited_before = popen.poll() is not None
        killed = False
        if not exited_before:
            popen.send_signal(self.stop_signal)
            try:
                popen.wait(timeout)
            except subprocess.TimeoutExpired:
                killed = True
                popen.kill()
                popen.wait(10)
        left = self._processes_left_behind()
        outlived = tuple(f"{pid} {process_cmdline(pid)}" for pid in left)
        if left:
            self._kill_group()
        return ExitReport(
            returncode=popen.returncode,
            ignored_stop_signal=killed,
            outlived=outlived,
            exited_before_stop=exited_before,
        )

    def _processes_left_behind(self) -> list[int]:
        if wait_until(lambda: not live_group_members(self.pid), self.follow_timeout):
            return []
        return live_group_members(self.pid)

    def kill(self) -> None:
        """The last resort for a caller that failed half-way: the server and everything
        it started are killed, at once."""
        if self._popen is None:
            return
        if self._popen.poll() is None:
            self._kill_group()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(10)
        elif live_group_members(self.pid):
            self._kill_group()

    def _kill_group(self) -> None:
        # The group is this server's own (start_new_session). Its id stays this server's
        # only while a member lives, which is why callers kill it only then.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    @contextlib.contextmanager
    def running(
        self: Server, *, check_exit: bool = True, startup_timeout: float = STARTUP_TIMEOUT_S
    ) -> Iterator[Server]:
        """The server healthy for the block, stopped after it. Raises ServerError if it
        ignored its stop signal or left a process behind, and with `check_exit` if it was
        still running when the block ended and did not then exit 0."""
        try:
            self.wait_healthy(startup_timeout)
            yield self
            problems = self.stop().problems(expect_success=check_exit)
            if problems:
                raise ServerError("; ".join(problems) + ":\n" + self.log_tail())
        finally:
            self.kill()

    # ------------------------------------------------------------------ inspection

    def url(self, path: str) -> str:
        return self.base_url + path

    def command_line(self) -> str:
        """The command as a shell would run it, with the environment it adds."""
        added = [f"{name}={shlex.quote(value)}" for name, value in self.added_env.items()]
        return " ".join([*added, shlex.join(self.command)])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])
