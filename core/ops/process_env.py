"""The environment an engine process starts with, for the compiled ops' sake.

Whoever spawns engine processes (an API server, the launcher) asks here rather than
knowing kernel settings itself: a spawned child reads its environment at start, and
OpenMP reads GOMP_SPINCOUNT once, when it loads. Torch-free, so the spawning side can
import it.
"""

from __future__ import annotations

# After each parallel region GNU OpenMP's threads spin 300000 turns (~6 ms here) before
# they sleep: at a batch-1 decode step that kept a second core busy through the step's
# Python, where the one-row matmuls' helper thread (row_pool.h) and the API server could
# have run. 2000 turns still cover the gaps between the regions of a batched step.
ENGINE_ENVIRONMENT = {"GOMP_SPINCOUNT": "2000"}


def engine_environment() -> dict[str, str]:
    """Variables an engine process should start with, where the user has not set them."""
    return dict(ENGINE_ENVIRONMENT)
