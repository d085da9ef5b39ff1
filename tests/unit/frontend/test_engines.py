"""How an API server starts its engines: forked from it while it runs a single thread,
each waiting until the server's channel is open, else from the fork server; and the
engine environment a process that forks its engines adopts before it loads OpenMP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from plugserve.bench.processes import pid_alive
from plugserve.ops.process_env import ENGINE_ENVIRONMENT, adopt_engine_environment

# A process that builds an API server's engines (two data-parallel ranks, never given a
# model to load), then does what argv[1] says; it prints what it saw.
SCRIPT = textwrap.dedent(
    """
    import json, sys, threading
    from plugserve.config import load_config
    from plugserve.frontend.engines import EngineProcesses

    config = load_config(overrides={"data_parallel_size": 2})
    engines = EngineProcesses(config, {})
    if sys.argv[1] == "with-a-thread":
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    if sys.argv[1] == "with-a-cuda-context":  # as torch says once a device was used
        import torch
        torch.cuda.is_initialized = lambda: True
    engines.prefork()
    print(json.dumps({"pids": engines.pids, "forked": len(engines.processes)}), flush=True)
    """
)


def _run(tmp_path: Path, how: str) -> dict:
    script = tmp_path / "engines.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), how], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_engines_forked_ahead_leave_with_their_parent_if_never_started(tmp_path: Path) -> None:
    seen = _run(tmp_path, "single-threaded")
    assert seen["forked"] == 2 and len(seen["pids"]) == 2
    # The parent exited without starting them: each saw its pipe close and left.
    deadline = time.monotonic() + 30
    while any(pid_alive(pid) for pid in seen["pids"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(pid) for pid in seen["pids"])


@pytest.mark.parametrize("state", ["with-a-thread", "with-a-cuda-context"])
def test_a_process_running_another_thread_or_holding_cuda_forks_no_engine(
    tmp_path: Path, state: str
) -> None:
    assert _run(tmp_path, state) == {"pids": [], "forked": 0}


def test_a_process_that_forks_engines_adopts_their_environment_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ENGINE_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    adopt_engine_environment()
    assert os.environ["GOMP_SPINCOUNT"] == "123"
    for name in set(ENGINE_ENVIRONMENT) - {"GOMP_SPINCOUNT"}:
        assert os.environ[name] == ENGINE_ENVIRONMENT[name]
