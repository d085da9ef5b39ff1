"""The environment an engine process starts with is the ops package's to say, and whoever
spawns engines can ask without loading torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from plugserve import ops
from plugserve.ops import process_env

ENGINE = {
    "GOMP_SPINCOUNT": "2000",
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "1073741824",
}


def test_engines_start_with_short_openmp_spinning_and_malloc_keeping_its_memory() -> None:
    environment = process_env.engine_environment()
    assert environment == ENGINE
    environment["GOMP_SPINCOUNT"] = "1"  # the caller's copy
    assert process_env.engine_environment() == ENGINE


def test_asking_loads_no_torch_but_the_kernel_api_stays_at_hand() -> None:
    code = (
        "import sys\n"
        "from plugserve.ops.process_env import engine_environment\n"
        "assert 'torch' not in sys.modules, 'plugserve.ops imported torch'\n"
        "import plugserve.ops\n"
        "plugserve.ops.include_dir()\n"
        "assert 'torch' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert ops.load is ops.build.load and ops.huge_page_buffer is ops.memory.huge_page_buffer


# Whether a 16 MiB block comes from its own mapping (glibc's default threshold is far
# below that) or from the heap, in a fresh process that may apply the setting first.
MALLOC_PROBE = """
import ctypes, os, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
if sys.argv[1] == "apply":
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(32 << 20)
    from plugserve.ops.process_env import apply_malloc_environment
    apply_malloc_environment()
mapped = libc.mallinfo2().hblkhd
libc.malloc(16 << 20)
print(libc.mallinfo2().hblkhd - mapped)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_forked_engine_applies_the_malloc_settings_its_parent_started_without() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def mapped(how: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", MALLOC_PROBE, how], capture_output=True, text=True, env=env
        )
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    assert mapped("as-started") >= 16 << 20
    assert mapped("apply") == 0
