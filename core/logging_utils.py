"""Every log line names its process and pid, so the two sides of a server read apart."""

from __future__ import annotations

import logging
import os
import sys


def configure_process_logging(process_name: str, level: str | None = None) -> None:
    level = level or os.environ.get("PLUGSERVE_LOG_LEVEL", "INFO")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s {process_name} pid=%(process)d %(levelname)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
    )
    for name in ("plugserve", "plugserve_plugins", "uvicorn", "uvicorn.error", "uvicorn.access"):
        log = logging.getLogger(name)
        log.handlers = [handler]
        log.setLevel(level)
        log.propagate = False
