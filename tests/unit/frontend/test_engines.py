"""The environment engine processes start with: the compiled ops' wishes
(plugserve.ops.process_env), applied by whoever spawns the engines."""

from __future__ import annotations

import os

import pytest

from plugserve.frontend import engines
from plugserve.ops.process_env import ENGINE_ENVIRONMENT


def test_engines_start_with_short_openmp_spinning_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with engines._engine_environment():
        assert os.environ["GOMP_SPINCOUNT"] == ENGINE_ENVIRONMENT["GOMP_SPINCOUNT"]
    assert "GOMP_SPINCOUNT" not in os.environ  # the API server's own is left as it was

    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    with engines._engine_environment():
        assert os.environ["GOMP_SPINCOUNT"] == "123"
    assert os.environ["GOMP_SPINCOUNT"] == "123"
