"""Ending a plugserve process once its own shutdown is done."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End this process with `code` without the interpreter's teardown, which frees every
    module's objects one by one: a second or more once torch and transformers are loaded,
    and a thread still blocked on a dead peer can hold it up for good. For a process whose
    shutdown is done (its children stopped, its channels closed): the logs and the
    standard streams are flushed here, and nothing else needs a finalizer."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
