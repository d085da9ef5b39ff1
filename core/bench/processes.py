"""What /proc says about a server's processes: their command lines (which setproctitle
rewrites into titles), their children, and whether they are still alive. Linux only,
as the servers these look at are."""

from __future__ import annotations

import contextlib
from pathlib import Path


def process_cmdline(pid: int) -> str:
    """The command line as ps shows it; '' if the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def children_of(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found


def descendants_of(pid: int) -> list[int]:
    """Children, their children and so on: a server's engines are children of its fork
    server (plugserve.child_processes), and an engine's workers of the engine's."""
    found: list[int] = []
    todo = children_of(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children_of(child)
    return found


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...):
    the name is in parentheses and may itself hold spaces or parentheses."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def live_group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that are alive and not zombies."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members
