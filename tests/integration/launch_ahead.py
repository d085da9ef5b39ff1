"""Servers launched one test ahead, so that a server's start overlaps the test before it.

Most of an integration test's time is its server starting (imports, model load, packing)
while the test before it mostly waits on one engine thread: the second core is idle. A
test that starts a server declares it with `@pytest.mark.starts_server(**kwargs)`, the
keyword arguments `running_server` will get (without `transport`, the test's `transport`
parameter is used); a test whose set-up starts a module's server carries the mark for it.
While the test before it runs, that server is launched; `running_server` then takes it
instead of launching its own when everything that makes the server (command line and
whole environment) is the same, and otherwise launches its own as before. A launched server
that no test took is killed at the end of the session. The mark changes when a server
starts, never which server a test gets.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from plugserve.bench.plugserve_server import PlugserveServer

MARK = "starts_server"


@dataclass(frozen=True)
class ServerSpec:
    """What `running_server` is called with, as a dictionary key."""

    transport: str
    settings: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    @classmethod
    def of(
        cls, transport: str, settings: tuple[str, ...], env: dict[str, str] | None
    ) -> ServerSpec:
        return cls(transport, tuple(settings), tuple(sorted((env or {}).items())))


@dataclass
class LaunchAhead:
    """The servers launched for tests still to come, by what they were launched with."""

    make: Callable[[ServerSpec, Path], PlugserveServer]
    defaults: dict[str, Any]
    pending: dict[ServerSpec, PlugserveServer] = field(default_factory=dict)
    _following: dict[str, pytest.Item | None] = field(default_factory=dict)
    launched: int = 0
    taken: int = 0

    def follow(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """Note the item this process runs after `item`: pytest's `nextitem`, which under
        xdist is the next test of this worker's own queue, not of the collected list."""
        self._following[item.nodeid] = nextitem

    def following(self, item: pytest.Item) -> pytest.Item | None:
        """The item this process runs after `item`."""
        return self._following.get(item.nodeid)

    def specs_of(self, item: pytest.Item) -> list[ServerSpec]:
        specs = []
        for mark in item.iter_markers(MARK):
            kwargs = {**self.defaults, **mark.kwargs}
            callspec = getattr(item, "callspec", None)
            transport = kwargs.pop("transport", None) or (
                callspec.params.get("transport") if callspec is not None else None
            )
            if transport is None:
                raise pytest.UsageError(f"{item.nodeid}: {MARK} names no transport")
            specs.append(ServerSpec.of(transport, kwargs["settings"], kwargs.get("env")))
        return specs

    def launch_for(self, item: pytest.Item) -> None:
        for spec in self.specs_of(item):
            if spec not in self.pending:
                log_dir = Path(tempfile.mkdtemp(prefix="plugserve-ahead-"))
                self.pending[spec] = self.make(spec, log_dir).launch()
                self.launched += 1

    def take(self, spec: ServerSpec, wanted: PlugserveServer) -> PlugserveServer:
        """The server launched ahead for `spec` if it runs what `wanted` would, else
        `wanted` (and one launched for nothing is killed)."""
        ahead = self.pending.pop(spec, None)
        if ahead is None:
            return wanted
        if _without_port(ahead.command) != _without_port(wanted.command) or _own(ahead.env) != _own(
            wanted.env
        ):
            ahead.kill()
            return wanted
        self.taken += 1
        return ahead

    def kill_all(self) -> None:
        """At the end of the session: a server still pending was launched for nothing
        (a test that was deselected or failed first, or a mark on the wrong test)."""
        for server in self.pending.values():
            server.kill()
        self.pending.clear()


def _without_port(command: list[str]) -> list[str]:
    """The command line less its `--port N`: each server gets a free port of its own."""
    at = command.index("--port")
    return command[:at] + command[at + 2 :]


# pytest names the running test in the environment: a server launched during the test
# before differs from the one its own test would start in that variable alone.
PER_TEST_ENV = "PYTEST_CURRENT_TEST"


def _own(env: dict[str, str]) -> dict[str, str]:
    """The environment that makes the server, less pytest's name of the running test."""
    return {name: value for name, value in env.items() if name != PER_TEST_ENV}
