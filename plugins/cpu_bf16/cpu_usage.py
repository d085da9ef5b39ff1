"""How much of the machine's CPU time processes outside this server took while the kernels
were timed (kernel_choice.py): a plan timed on a contended machine is used, not kept."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuUsage:
    """CPU seconds since boot: the whole machine's busy time (steal included) and this
    process group's (the server: API process, engine, workers)."""

    wall: float
    machine_busy: float
    own_group: float


def cpu_usage(proc: Path = Path("/proc")) -> CpuUsage | None:
    """Now's CpuUsage, from `proc` (Linux's /proc; a test's copy); None where it has no
    stat file (not Linux)."""
    try:
        fields = (proc / "stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
    busy = (user + nice + system + irq + softirq + steal) / tick
    group = os.getpgrp()
    own = 0
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        # After "pid (comm)" (comm may hold spaces): state ppid pgrp ... utime stime at
        # fields 14 and 15 of the whole line.
        rest = text[text.rindex(")") + 2 :].split()
        if int(rest[2]) == group:
            own += int(rest[11]) + int(rest[12])
    return CpuUsage(time.monotonic(), busy, own / tick)


def others_share(before: CpuUsage | None, after: CpuUsage | None) -> float | None:
    """The share of the machine's CPU time between two CpuUsage that went to processes
    outside this process group, or was stolen by the hypervisor."""
    if before is None or after is None or after.wall <= before.wall:
        return None
    capacity = (after.wall - before.wall) * (os.cpu_count() or 1)
    others = (after.machine_busy - before.machine_busy) - (after.own_group - before.own_group)
    return min(1.0, max(0.0, others / capacity))
