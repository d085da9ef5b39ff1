"""The environment an engine process starts with is the ops package's to say, and whoever
spawns engines can ask without loading torch."""

from __future__ import annotations

import subprocess
import sys

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
