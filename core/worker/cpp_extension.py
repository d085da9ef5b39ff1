"""Builds and loads small C++ operator libraries for the CPU, once per machine.

A library is one .cpp file that registers torch operators (TORCH_LIBRARY); it may include
the headers beside this module (cpu_bf16.h). It is compiled with the system C++ compiler
($CXX, else g++) against torch's own headers and OpenMP runtime, with -march=native, into
the plugserve cache, keyed by the source, those headers, the torch version and the CPU's
feature flags (code built for one CPU may not run on another).
Where it cannot be built (no compiler, no headers) `load` logs why once and returns False
(`unavailable_reason` returns why), and callers keep their pure-torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

from plugserve.worker.model_loader import cache_root

logger = logging.getLogger(__name__)

# Headers shared by the kernels (cpu_bf16.h), core's and plugins' alike.
_INCLUDE = Path(__file__).parent
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# Per source once tried: None where loaded, else why not.
_failures: dict[Path, str | None] = {}


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
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                *(header.read_bytes() for header in _headers()),
                torch.__version__.encode(),
                platform.machine().encode(),
                cpu_flags().encode(),
                " ".join(_FLAGS).encode(),
            ]
        )
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
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


def _headers() -> list[Path]:
    return sorted(_INCLUDE.glob("*.h"))


def _build(source: Path, target: Path) -> None:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compiler = os.environ.get("CXX", "g++")
    cmd = [
        *shlex.split(compiler),
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
    target.parent.mkdir(parents=True, exist_ok=True)
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
            error = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(f"{compiler} failed: {error[0] if error else done.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def cpu_flags() -> str:
    """The CPU's feature flags: /proc/cpuinfo's "flags" line, read once (the kernel
    dispatch asks for every weight it packs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
