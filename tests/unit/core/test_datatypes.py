"""The types that cross a boundary between parts have one home, plugserve.datatypes: each
is defined there, and the engine and worker modules that held them before are gone, so a
plugin cannot take one from two places."""

from __future__ import annotations

import importlib.util

import pytest

import plugserve.datatypes as datatypes

FORMER_HOMES = [
    "plugserve.engine.request",
    "plugserve.engine.scheduler_output",
    "plugserve.worker.model_runner_output",
]


@pytest.mark.parametrize("name", datatypes.__all__)
def test_every_datatype_is_defined_in_the_datatypes_package(name: str) -> None:
    assert getattr(datatypes, name).__module__.startswith("plugserve.datatypes.")


@pytest.mark.parametrize("module", FORMER_HOMES)
def test_the_modules_that_held_them_before_are_gone(module: str) -> None:
    assert importlib.util.find_spec(module) is None
