"""The server harness the tests and the benchmarks share (plugserve.bench.server_process),
on a stand-in server (stand_in_server.py) that behaves as each case needs: a server is
waited on until healthy, stopped, and reported when it exits badly, ignores its stop
signal or leaves a process behind; nothing it started outlives the harness."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from plugserve.bench.processes import live_group_members, pid_alive
from plugserve.bench.server_process import ServerError, ServerProcess, free_port, wait_until

STAND_IN = Path(__file__).with_name("stand_in_server.py")


def group_ends(pgid: int) -> bool:
    """Killed processes take a moment to be reaped; a bounded wait for it."""
    return bool(wait_until(lambda: not live_group_members(pgid), 10))


def stand_in(tmp_path: Path, mode: str, **options) -> ServerProcess:
    port = options.pop("port", None) or free_port()
    return ServerProcess(
        [sys.executable, str(STAND_IN), str(port), mode],
        port=port,
        log_path=tmp_path / f"{mode}.log",
        ready_line=options.pop("ready_line", f"serving on {port}"),
        poll_interval=0.05,
        follow_timeout=0.5,
        **options,
    )


def test_a_server_is_healthy_for_the_block_and_gone_after_it(tmp_path: Path) -> None:
    server = stand_in(tmp_path, "clean")
    with server.running() as running:
        assert httpx.get(running.url("/health")).status_code == 200
        assert running.healthy_after is not None
        group = running.pid
    assert server.popen.returncode == 0
    assert group_ends(group)


def test_a_server_that_exits_while_starting_fails_with_its_code_and_log(tmp_path: Path) -> None:
    with pytest.raises(ServerError, match=r"exited with 3 before it was healthy(.|\n)*gives up"):
        stand_in(tmp_path, "dies").wait_healthy(timeout=60)


def test_another_server_on_the_port_does_not_pass_for_this_one(tmp_path: Path) -> None:
    with stand_in(tmp_path, "clean").running() as other:
        impostor = ServerProcess(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            port=other.port,
            log_path=tmp_path / "impostor.log",
            ready_line="a line it never writes",
        )
        with pytest.raises(ServerError, match="not healthy within"):
            impostor.wait_healthy(timeout=0.5)
        impostor.kill()


def test_a_nonzero_exit_on_the_stop_signal_fails_unless_excused(tmp_path: Path) -> None:
    with (
        pytest.raises(ServerError, match="exited with 1 when stopped"),
        stand_in(tmp_path, "fails").running(),
    ):
        pass
    with stand_in(tmp_path, "fails").running(check_exit=False) as excused:
        pass
    assert excused.popen.returncode == 1


def test_a_server_that_ignores_its_stop_signal_is_killed_and_reported(tmp_path: Path) -> None:
    server = stand_in(tmp_path, "ignores")
    server.wait_healthy(timeout=60)
    report = server.stop(timeout=0.5)
    assert report.ignored_stop_signal
    assert report.problems(expect_success=False) == [
        "it did not exit on its stop signal and was killed"
    ]
    assert not pid_alive(server.pid)


def test_a_process_left_behind_is_named_and_killed(tmp_path: Path) -> None:
    server = stand_in(tmp_path, "leaves-child")
    outlived = r"processes outlived it: \d+ .*the stand-in's child"
    with pytest.raises(ServerError, match=outlived), server.running():
        pass
    assert group_ends(server.pid)


def test_a_server_that_was_never_healthy_is_still_cleaned_up(tmp_path: Path) -> None:
    server = stand_in(tmp_path, "leaves-child", ready_line="a line it never writes")
    with (
        pytest.raises(ServerError, match="not healthy within"),
        server.running(startup_timeout=0.5),
    ):
        pass
    assert not pid_alive(server.pid)
    assert group_ends(server.pid)


def test_the_command_line_shows_the_environment_it_adds(tmp_path: Path) -> None:
    server = ServerProcess(
        ["serve", "--flag", "two words"], port=1, log_path=tmp_path / "x.log", env={"A": "b c"}
    )
    assert server.command_line() == "A='b c' serve --flag 'two words'"
