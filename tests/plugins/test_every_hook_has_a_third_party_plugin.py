"""Every hook spec in plugserve.hookspecs is implemented by a plugin registered the way a
third party's is, and some test exercises that plugin: what plugserve promises a plugin
author is proven from the outside, not only by the bundled plugins, which ship inside
plugserve's own distribution.

A plugin counts when it comes through one of the registry's paths for outside code:
- an entry point of an installed distribution other than plugserve (the example packages
  under tests/plugins/, which the Makefile installs), loaded by the registry itself;
- a module a test names for PLUGSERVE_PLUGIN_MODULES (tests/plugins/minimal/,
  tests/integration/*_plugin.py), loaded by the registry itself;
- an object a test hands to `PluginRegistry.register` with a distribution of its own.
A test exercises it when the test module names it (its entry point, distribution, module
or a name it registers, as a string or an import) or registers it itself.

The specs are read from the module when this runs: a hook added later is held to this as
soon as it exists.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from plugserve import hookspecs
from plugserve.plugins import (
    BUILTIN_DISTRIBUTION,
    ENTRY_POINT_GROUP,
    SLOT_HOOKS,
    PluginRegistry,
)

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
DOTTED_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def hook_specs() -> list[str]:
    """The hooks plugserve.hookspecs declares (pluggy marks each `<project>_spec`)."""
    marker = f"{ENTRY_POINT_GROUP}_spec"
    return sorted(name for name, value in vars(hookspecs).items() if hasattr(value, marker))


@dataclass
class ScannedModule:
    path: Path
    # Every string literal and every imported module name in it.
    names: set[str] = field(default_factory=set)
    # The hooks of the objects it registers under a distribution of its own.
    registered_hooks: set[str] = field(default_factory=set)

    @property
    def shown(self) -> str:
        return str(self.path.relative_to(REPO))


def read_test_module(path: Path) -> ScannedModule:
    tree = ast.parse(path.read_text(), filename=str(path))
    module = ScannedModule(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            module.names.add(node.value)
        elif isinstance(node, ast.Import):
            module.names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module.names.add(node.module)
        elif _registers_a_third_party_plugin(node):
            module.registered_hooks |= _hook_names(node.args[0], tree)
    return module


def _registers_a_third_party_plugin(node: ast.AST) -> bool:
    """`<registry>.register(plugin, name, distribution)`, the distribution not plugserve's."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    if node.func.attr != "register" or not node.args:
        return False
    keywords = {k.arg: k.value for k in node.keywords}
    distribution = node.args[2] if len(node.args) >= 3 else keywords.get("distribution")
    return distribution is not None and not (
        isinstance(distribution, ast.Constant) and distribution.value == BUILTIN_DISTRIBUTION
    )


def _hook_names(plugin: ast.expr, tree: ast.Module) -> set[str]:
    """The keyword names the plugin object is built with (SimpleNamespace(hook=...) or a
    helper of the same shape), directly or through the name it was assigned to."""
    if isinstance(plugin, ast.Call):
        return {k.arg for k in plugin.keywords if k.arg}
    if isinstance(plugin, ast.Name):
        return {
            name
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            for target in node.targets
            if isinstance(target, ast.Name) and target.id == plugin.id
            for name in _hook_names(node.value, tree)
        }
    return set()


@pytest.fixture(scope="module")
def scanned_modules() -> list[ScannedModule]:
    here = Path(__file__).resolve()
    return [read_test_module(p) for p in sorted(TESTS.rglob("test_*.py")) if p != here]


def implementers(registry: PluginRegistry, spec: str) -> set[str]:
    """The plugins (by registered name) that implement `spec` in this registry."""
    return {impl.plugin_name for impl in getattr(registry.hook, spec).get_hookimpls()}


def installed_plugins_evidence(specs: list[str], modules: list[ScannedModule]) -> dict[str, list]:
    """spec → "<entry point> (<distribution>), named by <test module>" for each installed
    third-party plugin that implements it and a test names."""
    registry = PluginRegistry()
    registry.load()
    found: dict[str, list[str]] = defaultdict(list)
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        distribution = entry_point.dist.metadata["Name"] if entry_point.dist else None
        if distribution in (None, BUILTIN_DISTRIBUTION):
            continue
        names = {entry_point.name, distribution, entry_point.value.partition(":")[0]}
        names |= {
            name
            for slot in SLOT_HOOKS
            for name, impl in registry.implementations(slot).items()
            if impl.plugin == entry_point.name
        }
        naming = [m.shown for m in modules if m.names & names]
        for spec in specs:
            if naming and entry_point.name in implementers(registry, spec):
                found[spec].append(f"{entry_point.name} ({distribution}), named by {naming[0]}")
    return found


def plugin_modules_evidence(
    specs: list[str], modules: list[ScannedModule], monkeypatch: pytest.MonkeyPatch
) -> dict[str, list[str]]:
    """spec → "<module>, loaded by <test module>" for each plugin module a test names
    (a dotted name of a file under the repository that defines hook implementations),
    loaded as PLUGSERVE_PLUGIN_MODULES loads one."""
    named_by: dict[str, str] = {}
    for module in modules:
        for name in filter(DOTTED_MODULE_NAME.fullmatch, module.names):
            source = REPO / (name.replace(".", "/") + ".py")
            if source.is_file() and "hookimpl" in source.read_text():
                named_by.setdefault(name, module.shown)
    monkeypatch.setenv("PLUGSERVE_PLUGIN_MODULES", ",".join(sorted(named_by)))
    registry = PluginRegistry()
    registry.load()
    found: dict[str, list[str]] = defaultdict(list)
    for spec in specs:
        for name in sorted(implementers(registry, spec) & set(named_by)):
            found[spec].append(f"{name}, loaded by {named_by[name]}")
    return found


def registered_objects_evidence(specs: list[str], modules: list[ScannedModule]) -> dict[str, list]:
    """spec → "registered by <test module>" for each test that registers an object
    implementing it under a distribution of its own."""
    found: dict[str, list[str]] = defaultdict(list)
    for module in modules:
        for spec in sorted(module.registered_hooks & set(specs)):
            found[spec].append(f"registered by {module.shown}")
    return found


def test_every_hook_spec_has_a_third_party_plugin_a_test_exercises(
    scanned_modules: list[ScannedModule], monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = hook_specs()
    assert specs, "plugserve.hookspecs declares no hook"
    evidence = defaultdict(list)
    for found in (
        installed_plugins_evidence(specs, scanned_modules),
        plugin_modules_evidence(specs, scanned_modules, monkeypatch),
        registered_objects_evidence(specs, scanned_modules),
    ):
        for spec, where in found.items():
            evidence[spec] += where
    missing = [spec for spec in specs if not evidence[spec]]
    assert not missing, (
        "hook specs no test exercises through a third-party plugin: "
        + ", ".join(missing)
        + " (add the smallest real implementation to tests/plugins/minimal/ or an example"
        " package, and a test that selects it)"
    )


def test_the_check_sees_each_way_a_test_registers_a_plugin(tmp_path: Path) -> None:
    source = tmp_path / "test_example.py"
    source.write_text(
        "import types\n"
        "from plugserve_acme import thing\n"
        "observer = types.SimpleNamespace(engine_step_finished=lambda stats: None)\n"
        "registry.register(observer, name='observer', distribution='acme')\n"
        "registry.register(_plugin(register_models=f), 'models', 'acme-models')\n"
        "registry.register(types.SimpleNamespace(register_executors=f), 'x', 'plugserve')\n"
        "ENV = {'PLUGSERVE_PLUGIN_MODULES': 'tests.plugins.minimal.renderer'}\n"
    )
    module = read_test_module(source)
    assert module.registered_hooks == {"engine_step_finished", "register_models"}
    assert {"plugserve_acme", "tests.plugins.minimal.renderer"} <= module.names
