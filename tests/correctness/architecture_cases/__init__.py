"""One module per model family, each with CASES: a list of TinyCase (the family's own
transformers config at a tiny size, its structural options switched on).
test_architectures_match_hf.py runs every module's cases (in one process and at TP=2)
and fails for an architecture the core registers that no case builds; a new family adds
a module."""

from __future__ import annotations

import importlib
import pkgutil

from correctness.tiny_checkpoints import TinyCase


def all_cases() -> list[TinyCase]:
    cases: list[TinyCase] = []
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        cases += importlib.import_module(f"{__name__}.{module.name}").CASES
    return cases


def one_case_per_family() -> list[TinyCase]:
    """The first case of each transformers config class: what a family's layers do to the
    linears (their sharding, their quantization) its other cases share, biases aside."""
    first: dict[type, TinyCase] = {}
    for case in all_cases():
        first.setdefault(type(case.config), case)
    return list(first.values())
