"""Kept importable for one release: SchedulerOutput and its parts now live in
plugserve.datatypes.scheduler_output, so that executors and the Protocols need not
import the engine. Import them from plugserve.datatypes."""

from __future__ import annotations

from plugserve.datatypes.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)

__all__ = ["CachedRequestData", "NewRequestData", "SchedulerOutput"]
