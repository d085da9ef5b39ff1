"""Ending part of a running engine mid-request, for the executors' failure tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from plugserve import LLM, SamplingParams


def fail_mid_request(llm: LLM, end_it: Callable[[], object]) -> tuple[BaseException, float]:
    """Start a long request, call `end_it()` (kill a node or a rank) once it decodes; the
    error the request ended with and the seconds from `end_it` to it."""
    errors: list[tuple[BaseException, float]] = []

    def long_generate() -> None:
        try:
            llm.generate("Once", SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
        except BaseException as exc:
            errors.append((exc, time.monotonic()))

    thread = threading.Thread(target=long_generate, daemon=True)  # a hang must not block exit
    thread.start()
    deadline = time.monotonic() + 120
    while not any(r.num_output_tokens > 2 for r in list(llm.engine.scheduler.running)):
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    ended = time.monotonic()
    end_it()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the request outlived what ended"
    ((error, at),) = errors
    return error, at - ended
