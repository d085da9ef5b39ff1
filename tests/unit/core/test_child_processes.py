"""Child processes (engine cores, workers, API servers) are forked from a fork server
that has imported what they need, start with the engine environment OpenMP and malloc
read at load, and see their parent's environment as it is when they are started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from multiprocessing.connection import Connection
from pathlib import Path

from plugserve.child_processes import process_context, start_child
from plugserve.ops.process_env import ENGINE_ENVIRONMENT


def _report_modules(conn: Connection) -> None:
    conn.send({name: name in sys.modules for name in ("torch", "plugserve.engine.engine_proc")})


def test_a_child_finds_torch_and_the_engine_already_imported() -> None:
    ours, theirs = process_context().Pipe()
    child = start_child(_report_modules, (theirs,), name="Reporter")
    theirs.close()
    assert ours.recv() == {"torch": True, "plugserve.engine.engine_proc": True}
    child.join(30)
    assert child.exitcode == 0


# Run as a script: the fork server of a fresh process starts under the environment the
# script sets first.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from plugserve.child_processes import process_context, start_child

    def report(conn):
        # The fork server's environment, as it was started with it.
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            at_start = dict(
                item.split("=", 1) for item in f.read().decode().split("\\0") if "=" in item
            )
        conn.send({
            "spin_at_start": at_start.get("GOMP_SPINCOUNT"),
            "spin": os.environ.get("GOMP_SPINCOUNT"),
            "set_later": os.environ.get("SET_LATER"),
            "unset_later": os.environ.get("UNSET_LATER"),
        })

    if __name__ == "__main__":
        results = []
        for _ in range(2):
            ours, theirs = process_context().Pipe()
            start_child(report, (theirs,), name="Reporter").join(30)
            results.append(ours.recv())
            os.environ["SET_LATER"] = "yes"
            os.environ.pop("UNSET_LATER", None)
        print(json.dumps(results))
    """
)


def _run(tmp_path: Path, env: dict[str, str]) -> list[dict[str, str | None]]:
    script = tmp_path / "children.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_children_start_with_the_engine_environment_and_the_parents_of_the_moment(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    first, second = _run(tmp_path, {**env, "UNSET_LATER": "set"})
    spin = ENGINE_ENVIRONMENT["GOMP_SPINCOUNT"]
    assert first == {"spin_at_start": spin, "spin": spin, "set_later": None, "unset_later": "set"}
    assert second == {"spin_at_start": spin, "spin": spin, "set_later": "yes", "unset_later": None}


def test_a_users_own_setting_of_an_engine_variable_stands(tmp_path: Path) -> None:
    env = dict(os.environ)
    first, _ = _run(tmp_path, {**env, "GOMP_SPINCOUNT": "123"})
    assert first["spin_at_start"] == "123" and first["spin"] == "123"
