"""docs/writing-plugins.md against the code: what a plugin author can fill and declare is
read from plugserve itself, and each test fails naming what the page leaves out.

- every slot of the registry (plugserve.plugins.SLOT_HOOKS) has a table row naming the
  slot, its hook and its Protocol with the Protocol's module; the Protocol is the one the
  hook's docstring in plugserve.hookspecs names (`interfaces.<module>.<Class>`);
- every hook spec (each function of plugserve.hookspecs marked as one: the `register_*`
  hooks and the observers) is named;
- every capability (each typing.Protocol class of plugserve.capabilities) has a row naming
  it with its check function (the function returning a TypeGuard of it).
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

from plugserve import capabilities, hookspecs
from plugserve.plugins import SLOT_HOOKS

DOC = Path(__file__).resolve().parents[3] / "docs" / "writing-plugins.md"
PROTOCOL_REFERENCE = re.compile(r"\binterfaces\.(\w+)\.([A-Z]\w*)")


def _doc_lines() -> list[str]:
    return DOC.read_text().splitlines()


def _has_row(lines: list[str], *words: str) -> bool:
    """Whether one line of the page names every one of `words` in backticks."""
    return any(all(f"`{word}`" in line for word in words) for line in lines)


def _names(lines: list[str], name: str) -> bool:
    """Whether the page names `name` in backticks, alone or called: `name` or `name(...)`."""
    pattern = re.compile(rf"`{re.escape(name)}(\(|`)")
    return any(pattern.search(line) for line in lines)


def hook_specs() -> dict[str, object]:
    """Every hook the core declares, by name."""
    return {
        name: function
        for name, function in inspect.getmembers(hookspecs, inspect.isfunction)
        if getattr(function, "plugserve_spec", None) is not None
    }


def slot_protocol(hook_name: str) -> tuple[str, str]:
    """(module, Protocol) the slot hook's docstring names, checked to exist."""
    doc = inspect.getdoc(getattr(hookspecs, hook_name)) or ""
    found = PROTOCOL_REFERENCE.search(doc)
    assert found, (
        f"hookspecs.{hook_name} names no Protocol in its docstring: write it as "
        "interfaces.<module>.<Class>"
    )
    module_name, protocol = found.groups()
    module = importlib.import_module(f"plugserve.interfaces.{module_name}")
    assert hasattr(module, protocol), f"hookspecs.{hook_name} names {found.group(0)}, not found"
    return f"plugserve.interfaces.{module_name}", protocol


def capability_checks() -> dict[str, list[str]]:
    """Each capability Protocol of plugserve.capabilities with its check functions."""
    protocols = [
        name
        for name, cls in inspect.getmembers(capabilities, inspect.isclass)
        if cls.__module__ == capabilities.__name__ and getattr(cls, "_is_protocol", False)
    ]
    functions = inspect.getmembers(capabilities, inspect.isfunction)
    checks: dict[str, list[str]] = {}
    for protocol in protocols:
        guards = re.compile(rf"TypeGuard\[(type\[)?{protocol}\]")
        checks[protocol] = [
            name
            for name, function in functions
            if function.__module__ == capabilities.__name__
            and guards.search(str(function.__annotations__.get("return", "")))
        ]
    return checks


def test_the_page_and_the_code_have_what_these_tests_read() -> None:
    assert DOC.is_file()
    assert SLOT_HOOKS, "the registry names no slots"
    assert any(name.startswith("register_") for name in hook_specs())
    assert capability_checks(), "plugserve.capabilities declares no Protocol"


def test_every_slot_has_a_row_with_its_hook_and_protocol() -> None:
    lines = _doc_lines()
    missing = []
    for slot, hook in SLOT_HOOKS.items():
        module, protocol = slot_protocol(hook)
        if not _has_row(lines, slot, hook, protocol, module):
            missing.append(f"slot {slot!r} (hook {hook}, Protocol {protocol} in {module})")
    assert not missing, (
        f"{DOC.name} has no row naming, in backticks, each of these slots with its hook, "
        f"its Protocol and the Protocol's module: {'; '.join(missing)}"
    )


def test_every_hook_spec_is_named() -> None:
    lines = _doc_lines()
    missing = sorted(name for name in hook_specs() if not _names(lines, name))
    assert not missing, f"{DOC.name} does not name these hooks: {', '.join(missing)}"


def test_every_capability_has_a_row_with_its_check() -> None:
    lines = _doc_lines()
    missing = [
        f"{protocol} ({', '.join(checks) or 'no check function'})"
        for protocol, checks in capability_checks().items()
        if not _has_row(lines, protocol, *checks)
    ]
    assert not missing, (
        f"{DOC.name} has no row naming, in backticks, these capabilities with their "
        f"check functions: {'; '.join(missing)}"
    )
