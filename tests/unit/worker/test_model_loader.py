"""The progress bar while a checkpoint's weights load: on a terminal for any but a tiny
checkpoint, in a log file only for a large one."""

from __future__ import annotations

import io

import torch

from plugserve.worker import model_loader
from plugserve.worker.model_loader import (
    LARGE_CHECKPOINT_BYTES,
    TTY_PROGRESS_MIN_BYTES,
    shows_progress,
    with_progress,
)


def test_a_bar_shows_on_a_terminal_or_for_a_large_checkpoint_only():
    assert not shows_progress(TTY_PROGRESS_MIN_BYTES - 1, tty=True)
    assert shows_progress(TTY_PROGRESS_MIN_BYTES, tty=True)
    # The embedded test model (hundreds of MB) leaves a test's log clean.
    assert not shows_progress(600 << 20, tty=False)
    assert shows_progress(LARGE_CHECKPOINT_BYTES, tty=False)


def test_the_bar_counts_the_bytes_of_every_tensor_it_passes_on(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr(model_loader.sys, "stderr", stderr)
    weights = [("a", torch.zeros(256, dtype=torch.float32)), ("b", torch.zeros(512, 2))]
    total = sum(t.numel() * t.element_size() for _, t in weights)
    assert [name for name, _ in with_progress(iter(weights), total)] == ["a", "b"]
    text = stderr.getvalue()
    assert "Loading weights" in text and "100%" in text, text
