"""How plugserve starts a child process where it cannot fork its own state: an `mp`
engine's workers, a launcher's API servers and engines, any child of an offline `LLM`.
(`plugserve serve` forks its engines from itself, frontend/engines.py.)

Each is forked from a fork server (multiprocessing's "forkserver" start method) that
has already imported what the children import: torch, transformers' configuration
classes, the engine and the installed plugins (plugserve.child_preload). A spawned child
starts a fresh interpreter and imports all of that itself, seconds of one core each
(docs/benchmarks-history.md, "Child processes from a fork server"). The fork server is
started once per parent process, imports and forks, nothing else: no thread of its own
runs in it and torch computes nothing there, so forking it is safe where forking the
parent (threads, an OpenMP pool, sockets) would not be.

A child gets the environment its parent has when it is started, as a spawned one does
(its target is imported after that; a module the fork server imported read the
environment its parent had when the fork server started), and the fork server starts
with the engine environment (plugserve.ops.process_env): OpenMP and malloc read those
variables once, when a process loads them, and the fork server is where they load.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Callable, Iterator
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any

from plugserve.ops.process_env import engine_environment

PRELOAD_MODULE = "plugserve.child_preload"
# What an engine imports that its API server imports too: torch (the plugins import it)
# and transformers' configuration and tokenizer classes. An architecture's configuration
# class imports transformers' shared validators, and with them its tensor-parallel
# helpers and sympy: most of a config's load time.
SHARED_MODULES = (
    "torch",
    "transformers.models.llama.configuration_llama",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto",
)


def import_modules(names: tuple[str, ...]) -> None:
    """Import each of `names` now; one that fails is left to whoever needs it, which
    imports it again and reports the error itself."""
    for name in names:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def process_context() -> ForkServerContext:
    """The start method's context, for its Pipe and Process types; `start_child` starts a
    process with it."""
    context = multiprocessing.get_context("forkserver")
    assert isinstance(context, ForkServerContext)
    context.set_forkserver_preload([PRELOAD_MODULE])
    return context


def _start_fork_server() -> None:
    """This process's fork server, started once under the engine environment."""
    process_context()
    with _engine_environment():
        multiprocessing.forkserver.ensure_running()


def start_child(
    target: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    name: str,
    daemon: bool = False,
) -> BaseProcess:
    """Start `target(*args)` in a child process named `name`; returns it started. The
    arguments are pickled (connections and sockets included, as for spawn)."""
    _start_fork_server()
    environment = {**engine_environment(), **os.environ}
    # The target goes by name, imported once the environment is in place: a module that
    # reads the environment when imported (the metrics client, for one) reads it right.
    where = (target.__module__, target.__qualname__)
    process = process_context().Process(
        target=_run_in_environment, args=(environment, where, args), name=name, daemon=daemon
    )
    process.start()
    return process


def _run_in_environment(
    environment: dict[str, str], where: tuple[str, str], args: tuple[Any, ...]
) -> None:
    """In the child: the parent's environment of the moment, then the target."""
    with contextlib.suppress(ImportError):
        import setproctitle

        # It takes the memory of the environment it finds at its first use for the
        # process title: the fork server's, before any change here.
        setproctitle.getproctitle()
    for key in os.environ.keys() - environment.keys():
        del os.environ[key]
    for key, value in environment.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    module, qualname = where
    target: Any = importlib.import_module(module)
    for attribute in qualname.split("."):
        target = getattr(target, attribute)
    target(*args)


@contextlib.contextmanager
def _engine_environment() -> Iterator[None]:
    """The engine environment, except what the user has set, while the fork server starts."""
    added = {k: v for k, v in engine_environment().items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
