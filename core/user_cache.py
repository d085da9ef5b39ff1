"""Where plugserve keeps what it makes once per machine: converted models, file hashes,
compiled kernels. A leaf module, so that every layer (model files, the compiled ops) can
name the place without importing another's internals."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$PLUGSERVE_CACHE_DIR, else $XDG_CACHE_HOME/plugserve, else ~/.cache/plugserve."""
    if explicit := os.environ.get("PLUGSERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "plugserve"
