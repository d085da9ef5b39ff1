"""Imported by the fork server that plugserve's child processes are forked from
(plugserve.child_processes), before the first fork: what an engine core and a worker
import, so that each child finds it imported. Not the API server's modules: the metrics
client among them picks its multiprocess mode from the environment when it is imported,
and a launcher sets that environment after its fork server has started.

Only imports: nothing here may start a thread of its own, open a socket or run a torch
operation, or the children would be forked from a process in the middle of one (numpy's
OpenBLAS pool, which importing torch starts, stops and restarts itself around a fork).
A module that fails to import is left to the child, which imports it again and reports
the error itself.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import os

from plugserve.child_processes import SHARED_MODULES, import_modules
from plugserve.plugins import ENTRY_POINT_GROUP

ENGINE_MODULES = ("plugserve.engine.engine_proc", "plugserve.worker.model_runner")


def _preload() -> None:
    import_modules(SHARED_MODULES)
    import_modules(ENGINE_MODULES)
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        with contextlib.suppress(Exception):
            entry_point.load()


_preload()
# The fork server ends (its parent gone) through the interpreter's teardown, which frees
# every module's objects one by one, long once torch is loaded, and a server's stop
# waits for it. Its children never run this: they leave through os._exit.
atexit.register(os._exit, 0)
