"""Moved to plugserve.ops (the build helper is plugserve.ops.build): kept importable for one
release so that a kernel plugin written against plugserve.worker.cpp_extension still loads.
New code imports plugserve.ops."""

from plugserve.ops.build import cache_dir, cpu_flags, load, unavailable_reason

__all__ = ["cache_dir", "cpu_flags", "load", "unavailable_reason"]
