"""Builds and loads small C++ operator libraries for the CPU, once per machine.

A library is one .cpp file that registers torch operators (TORCH_LIBRARY); it may include
the public headers in `include_dir()` (the ABI in plugserve.ops' docstring) and headers
beside itself. It is compiled with the system C++ compiler ($CXX, else g++) against
torch's own headers and OpenMP runtime, with -march=native, into the plugserve cache,
keyed by the source, the headers it includes (transitively), the torch version and the
CPU's feature flags (code built for one CPU may not run on another).
Where it cannot be built (no compiler, no headers) `load` logs why once and returns False
(`unavailable_reason` returns why), and callers keep their pure-torch path.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from plugserve.user_cache import cache_root

logger = logging.getLogger(__name__)

_INCLUDE = Path(__file__).with_name("include")
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# A quoted include, the only kind that can name one of our headers (<...> is for the
# system's and torch's, which the torch version in the key already covers).
_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
# Per source once tried: None where loaded, else why not.
_failures: dict[Path, str | None] = {}


def include_dir() -> Path:
    """The folder of the public headers, on every library's include path: a kernel plugin
    writes `#include "cpu_bf16.h"` and `load` finds it."""
    return _INCLUDE


def cache_dir() -> Path:
    return cache_root() / "kernels"


def load(source: Path) -> bool:
    """Build `source` if this machine has no build of it yet and load its operators into
    torch.ops; False (with the reason logged once) where that fails."""
    return unavailable_reason(source) is None


def unavailable_reason(source: Path) -> str | None:
    """`load(source)`, saying why not: None once its operators are loaded, else what
    failed (no C++ compiler, the compiler's first error, a library that does not load)."""
    if source in _failures:
        return _failures[source]
    target = _target(source)
    try:
        if not target.exists():
            logger.info("building %s (once): %s", source.name, target)
            _build(source, target)
        torch.ops.load_library(str(target))
        _failures[source] = None
    except Exception as exc:  # no compiler, no headers, an unsupported platform
        logger.warning("%s unavailable, using the torch fallback: %s", source.name, exc)
        _failures[source] = str(exc) or type(exc).__name__
    return _failures[source]


def build_missing(sources: Sequence[Path], workers: int) -> None:
    """Build, `workers` at a time (each build one compiler process), every one of
    `sources` this machine has no build of yet, without loading it: what `load` would
    otherwise build one by one, each at its library's first use. A source that does not
    build is left for `load` to report, with why, where it is used."""

    def build(source: Path) -> None:
        target = _target(source)
        if not target.exists():
            with contextlib.suppress(Exception):
                _build(source, target)

    with ThreadPoolExecutor(max(1, workers)) as pool:
        list(pool.map(build, sources))


def _target(source: Path) -> Path:
    return cache_dir() / f"{source.stem}-{cache_key(source)}.so"


def cache_key(source: Path, include: Path | None = None) -> str:
    """What a build of `source` depends on, hashed: its text and that of every header it
    includes, directly or through another header, so that editing a header rebuilds only
    the libraries that include it. `include` stands in for include_dir() (tests)."""
    headers = included_headers(source, include or _INCLUDE)
    parts = [source.read_bytes()]
    for header in headers:
        parts += [header.name.encode(), header.read_bytes()]
    parts += [
        torch.__version__.encode(),
        platform.machine().encode(),
        _machine_cpu_flags().encode(),
        " ".join(_FLAGS).encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def included_headers(source: Path, include: Path) -> list[Path]:
    """The headers `source` includes with quotes, transitively, found where the compiler
    looks: beside the including file first, then in `include`. Every #include counts,
    also those an #if leaves out (a key that changes too often only costs a rebuild).
    Names found in neither place are the compiler's to find, not ours to hash."""
    found: set[Path] = set()
    pending = [source]
    while pending:
        including = pending.pop()
        for name in _QUOTED_INCLUDE.findall(including.read_text()):
            for folder in (including.parent, include):
                header = (folder / name).resolve()
                if header.is_file():
                    if header not in found:
                        found.add(header)
                        pending.append(header)
                    break
    return sorted(found)


def _build(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    cmd = _compile_command(source)
    # Built beside the target and renamed into place: processes starting together
    # (data-parallel engines, tests) never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, timeout=600)
        except FileNotFoundError:
            raise RuntimeError(f"no C++ compiler: {cmd[0]} not found (set $CXX)") from None
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            # The first error, not the first line: torch's headers open with warnings.
            errors = [line for line in lines if "error" in line] or lines
            compiler = os.environ.get("CXX", "g++")
            raise RuntimeError(f"{compiler} failed: {errors[0] if errors else done.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compile_command(source: Path) -> list[str]:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        *shlex.split(os.environ.get("CXX", "g++")),
        *_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{_INCLUDE}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-I{Path(sys.base_prefix) / 'include'}",
        str(source),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        "-lgomp",
        f"-Wl,-rpath,{torch_lib}",
    ]


# Flags (comma- or space-separated) that cpu_flags() leaves out, so that every plugserve
# process decides as on a CPU without them (engine.dtype auto, the bf16 kernels): a
# test's way to be another CPU. Builds are still keyed by the real flags.
HIDE_CPU_FLAGS_ENV = "PLUGSERVE_HIDE_CPU_FLAGS"


@cache
def cpu_flags() -> str:
    """The CPU's feature flags: /proc/cpuinfo's "flags" line, read once (the kernel
    dispatch asks for every weight it packs), less those PLUGSERVE_HIDE_CPU_FLAGS names."""
    hidden = set(os.environ.get(HIDE_CPU_FLAGS_ENV, "").replace(",", " ").split())
    flags = _machine_cpu_flags()
    if not hidden:
        return flags
    return " ".join(flag for flag in flags.split() if flag not in hidden)


@cache
def _machine_cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
