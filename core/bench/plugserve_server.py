"""`plugserve serve` as a child process (server_process.ServerProcess), with what its
callers read of it: the processes it runs, by their titles, and its /metrics."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from plugserve.bench.processes import descendants_of, pid_alive, process_cmdline
from plugserve.bench.server_process import (
    STARTUP_TIMEOUT_S,
    ServerProcess,
    free_port,
    wait_until,
)

ENGINE_TITLE = "plugserve::EngineCore"
API_SERVER_TITLE = "plugserve::ApiServer"
# With --api-server-count N > 1: the launcher and its children ApiServer_0 … ApiServer_{N-1}.
LAUNCHER_TITLE = "plugserve::Launcher"
API_SERVER_CHILD_TITLE = "plugserve::ApiServer_"


def plugserve_command() -> list[str]:
    """The console script of the running environment (.venv/bin/plugserve), else the
    module, so the server runs the same plugserve as its caller."""
    script = Path(sys.executable).parent / "plugserve"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "plugserve.cli"]


def is_engine(pid: int) -> bool:
    return pid_alive(pid) and ENGINE_TITLE in process_cmdline(pid)


def is_api_server_child(pid: int) -> bool:
    return pid_alive(pid) and API_SERVER_CHILD_TITLE in process_cmdline(pid)


class PlugserveServer(ServerProcess):
    """`plugserve serve --port <free port>` with `settings` (its command-line flags), the
    given transport and config file."""

    def __init__(
        self,
        log_path: Path,
        *,
        settings: Sequence[str] = (),
        transport: str | None = None,
        config: Path | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        port = port or free_port()
        command = [*plugserve_command(), "serve", "--port", str(port)]
        if config is not None:
            command += ["--config", str(config)]
        if transport is not None:
            command += ["--stack.transport", transport]
        super().__init__(
            [*command, *settings],
            port=port,
            log_path=log_path,
            env=env,
            cwd=cwd,
            ready_line=f"running on http://127.0.0.1:{port}",
        )
        self.transport = transport
        self._engine_pids: list[int] = []
        self._api_server_pids: list[int] = []

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> float:
        seconds = super().wait_healthy(timeout)
        # Taken while healthy: a caller that kills one of them can then check it is gone.
        self._engine_pids = self.engine_pids()
        self._api_server_pids = self.api_server_pids()
        return seconds

    # ------------------------------------------------------------------ its processes

    def engine_pids(self) -> list[int]:
        """The server's processes titled plugserve::EngineCore (one per data-parallel rank)."""
        if self._engine_pids:
            return self._engine_pids
        return [c for c in descendants_of(self.pid) if ENGINE_TITLE in process_cmdline(c)]

    def api_server_pids(self) -> list[int]:
        """With --api-server-count N > 1, the processes titled plugserve::ApiServer_<i>,
        in index order; [] for a server that is its own (only) API server."""
        if self._api_server_pids:
            return self._api_server_pids
        children = [
            c for c in descendants_of(self.pid) if API_SERVER_CHILD_TITLE in process_cmdline(c)
        ]
        return sorted(children, key=lambda pid: process_cmdline(pid).split()[0])

    def engine_pid(self) -> int:
        """The engine of a server with one engine."""
        engines = self.engine_pids()
        assert len(engines) == 1, f"engine processes among the server's children: {engines}"
        return engines[0]

    # ------------------------------------------------------------------ its figures

    def metrics(self) -> dict[str, float]:
        """/metrics' samples by name, labels included (`engine_requests_total{engine="0"}`),
        without the `plugserve_` prefix."""
        response = httpx.get(self.url("/metrics"), timeout=30)
        response.raise_for_status()
        values = {}
        for line in response.text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name.removeprefix("plugserve_")] = float(value)
        return values

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits, the KV cache is empty and the
        engine's step counter stood still since the previous poll (the engine's figures
        come with its outputs, and the step that drops a last finished request from the
        runner is reported after it); returns the last metrics either way."""
        last: dict[str, float] = {}

        def idle() -> bool:
            steps = last.get("engine_steps_total")
            last.update(self.metrics())
            return (
                last["num_requests_running"] == 0
                and last["num_requests_waiting"] == 0
                and last["kv_cache_usage"] == 0
                and last["engine_steps_total"] == steps
            )

        wait_until(idle, timeout, interval=0.2)
        return last

    # ------------------------------------------------------------------ its clients

    def openai_client(self, **kwargs: Any) -> Any:
        """An openai.OpenAI on the server (the `openai` package: the dev extra). No
        retries: a caller must see the first answer, and a 503 must not be retried."""
        import openai

        options = {"max_retries": 0, "timeout": 120.0, "api_key": "unused", **kwargs}
        return openai.OpenAI(base_url=self.url("/v1"), **options)

    def async_openai_client(self, **kwargs: Any) -> Any:
        import openai

        options = {"max_retries": 0, "timeout": 300.0, "api_key": "unused", **kwargs}
        return openai.AsyncOpenAI(base_url=self.url("/v1"), **options)
