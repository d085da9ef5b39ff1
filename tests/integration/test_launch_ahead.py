"""A server launched ahead is what the test would have started itself, or it is not used.

Servers here are built, never launched: which one `take` hands back is decided before any
process exists."""

from __future__ import annotations

from pathlib import Path

from .conftest import SERVER_SETTINGS, server_under_test
from .launch_ahead import LaunchAhead, ServerSpec


def _ahead(tmp_path: Path) -> LaunchAhead:
    def make(spec: ServerSpec, log_dir: Path):
        return server_under_test(
            spec.transport, log_dir / "ahead.log", settings=spec.settings, env=dict(spec.env)
        )

    return LaunchAhead(make=make, defaults={"settings": SERVER_SETTINGS})


def test_the_server_launched_for_the_same_command_and_environment_is_taken(tmp_path):
    ahead = _ahead(tmp_path)
    spec = ServerSpec.of("zmq", SERVER_SETTINGS, {"A": "1"})
    launched = ahead.make(spec, tmp_path)
    ahead.pending[spec] = launched
    wanted = server_under_test("zmq", tmp_path / "own.log", env={"A": "1"})
    assert ahead.take(spec, wanted) is launched
    assert not ahead.pending


def test_a_server_launched_under_another_environment_is_not_taken(tmp_path, monkeypatch):
    ahead = _ahead(tmp_path)
    spec = ServerSpec.of("zmq", SERVER_SETTINGS, None)
    ahead.pending[spec] = ahead.make(spec, tmp_path)
    monkeypatch.setenv("PLUGSERVE_SOMETHING_THE_TEST_SET", "1")
    wanted = server_under_test("zmq", tmp_path / "own.log")
    assert ahead.take(spec, wanted) is wanted
    assert not ahead.pending


def test_without_a_launched_server_the_test_gets_its_own(tmp_path):
    wanted = server_under_test("shm", tmp_path / "own.log")
    assert _ahead(tmp_path).take(ServerSpec.of("shm", SERVER_SETTINGS, None), wanted) is wanted


def test_a_server_launched_during_the_test_before_is_taken(tmp_path, monkeypatch):
    """pytest's PYTEST_CURRENT_TEST names the test running when the server was launched,
    which is never the test that takes it."""
    ahead = _ahead(tmp_path)
    spec = ServerSpec.of("zmq", SERVER_SETTINGS, None)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/integration/test_x.py::test_before (call)")
    launched = ahead.make(spec, tmp_path)
    ahead.pending[spec] = launched
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/integration/test_x.py::test_after (call)")
    wanted = server_under_test("zmq", tmp_path / "own.log")
    assert ahead.take(spec, wanted) is launched
