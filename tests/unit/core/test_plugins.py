"""The plugin registry: discovery through entry points, resolution by name, conflicts."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import types
from pathlib import Path

import pytest
import tomllib

from plugserve import hookimpl
from plugserve.cli import main
from plugserve.plugins import SLOT_HOOKS, PluginError, PluginRegistry

BUNDLED = {
    "renderer": {"hf"},
    "detokenizer": {"incremental"},
    "scheduler": {"fcfs", "priority"},
    "kv_allocator": {"paged"},
    "executor": {"uni"},
    "attention": {"torch", "flashinfer"},
    "model": {"LlamaForCausalLM"},
}


def _plugin(**hooks) -> types.SimpleNamespace:
    """A plugin object the way a third-party module would provide its hooks."""
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


def test_bundled_plugins_are_found_through_entry_points():
    registry = PluginRegistry()
    for slot, names in BUNDLED.items():
        impls = registry.implementations(slot)
        assert names <= set(impls), slot
        for name in names:
            assert impls[name].distribution == "plugserve"


def test_unknown_name_lists_the_available_ones():
    registry = PluginRegistry()
    with pytest.raises(
        PluginError, match=r"unknown scheduler 'lottery'; available: fcfs, priority(, [a-z_]+)*$"
    ):
        registry.get("scheduler", "lottery")


def test_two_distributions_claiming_one_name_fail_naming_both():
    class Lottery:
        pass

    registry = PluginRegistry()
    registry.register(
        _plugin(register_scheduler_policies=lambda register: register("fcfs", Lottery)),
        name="acme_lottery",
        distribution="acme-lottery",
    )
    with pytest.raises(PluginError) as err:
        registry.implementations("scheduler")
    message = str(err.value)
    assert "'fcfs'" in message
    assert "'plugserve'" in message and "'acme-lottery'" in message


def test_a_third_party_plugin_adds_an_implementation():
    class Lottery:
        def __init__(self) -> None:
            self.built = True

    registry = PluginRegistry()
    registry.register(
        _plugin(register_scheduler_policies=lambda register: register("lottery", Lottery)),
        name="acme_lottery",
        distribution="acme-lottery",
    )
    impl = registry.implementations("scheduler")["lottery"]
    assert impl.distribution == "acme-lottery"
    assert registry.build("scheduler", "lottery").built


def test_an_implementation_of_an_unknown_hook_is_rejected():
    registry = PluginRegistry()
    registry.register(
        _plugin(register_widgets=lambda register: None), name="odd", distribution="odd"
    )
    with pytest.raises(PluginError, match="register_widgets"):
        registry.load()


def test_disable_blocks_a_bundled_plugin():
    registry = PluginRegistry(disable=["priority"])
    assert "priority" not in registry.implementations("scheduler")
    assert "fcfs" in registry.implementations("scheduler")


def test_options_are_validated_by_the_plugins_own_model():
    import pydantic

    class Knobs:
        class Options(pydantic.BaseModel):
            model_config = pydantic.ConfigDict(extra="forbid")
            ring_bytes: int = 1024

        def __init__(self, *, options: Options) -> None:
            self.options = options

    registry = PluginRegistry()
    registry.register(
        _plugin(register_transports=lambda register: register("knobs", Knobs)),
        name="knobs",
        distribution="acme-knobs",
    )
    assert registry.build("transport", "knobs", {"ring_bytes": 64}).options.ring_bytes == 64
    with pytest.raises(pydantic.ValidationError):
        registry.build("transport", "knobs", {"ring": 64})
    with pytest.raises(PluginError, match="takes no options"):
        registry.build("scheduler", "fcfs", {"x": 1})


def test_cli_lists_every_slot_with_distribution(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for slot in SLOT_HOOKS:
        assert f"{slot}:" in out
    assert "priority" in out and "plugserve" in out


def test_a_class_registered_by_reference_is_imported_on_first_use(tmp_path, monkeypatch):
    (tmp_path / "lazy_models_probe.py").write_text("class TinyLM:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def register_models(register):
        register("TinyLM", "lazy_models_probe:TinyLM")

    registry = PluginRegistry()
    registry.register(_plugin(register_models=register_models), "lazy", "lazy-dist")
    impl = registry.implementations("model")["TinyLM"]

    assert "lazy_models_probe" not in sys.modules  # registered, not imported
    assert impl.cls.__name__ == "TinyLM"
    assert impl.cls.__module__ == "lazy_models_probe"
    assert registry.get("model", "TinyLM") is impl.cls


def test_a_broken_reference_fails_naming_the_plugin_and_the_reference():
    def register_models(register):
        register("Ghost", "no_such_module_anywhere:Ghost")

    registry = PluginRegistry()
    registry.register(_plugin(register_models=register_models), "ghosts", "ghost-dist")
    with pytest.raises(PluginError, match=r"model 'Ghost' from plugin 'ghosts'.*no_such_module"):
        registry.get("model", "Ghost")


def test_loading_the_registry_imports_no_model_code():
    """The API server loads the registry for its own slots: every plugin module and the
    built-in model registrations import, but no worker module does."""
    probe = (
        "import sys\n"
        "from plugserve.plugins import SLOT_HOOKS, PluginRegistry\n"
        "registry = PluginRegistry()\n"
        "for slot in SLOT_HOOKS:\n"
        "    registry.implementations(slot)\n"
        "print([m for m in sys.modules if m.startswith('plugserve.worker')])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_loading_the_registry_imports_no_endpoint_code():
    """Every process loads the registry, the engines too; only an API server builds its
    endpoints (register_routes), so no route module, nor FastAPI, is imported before."""
    probe = (
        "import sys\n"
        "from plugserve.plugins import SLOT_HOOKS, PluginRegistry\n"
        "registry = PluginRegistry()\n"
        "for slot in SLOT_HOOKS:\n"
        "    registry.implementations(slot)\n"
        "print([m for m in sys.modules if m.startswith(('fastapi', 'plugserve.frontend.'))])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['plugserve.frontend.routes']", out.stdout


def test_every_bundled_entry_point_is_installed_and_registers_what_it_names():
    """Each plugin pyproject.toml declares is installed as declared, imports, and registers
    at least one implementation whose class imports: a plugin module that is missing or
    broken, or one that registers nothing, fails here."""
    pyproject = Path(__file__).parents[3] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["entry-points"]["plugserve"]
    installed = {
        ep.name: ep.value
        for ep in importlib.metadata.distribution("plugserve").entry_points
        if ep.group == "plugserve"
    }
    assert installed == declared, "reinstall: the installed entry points differ from pyproject"
    registry = PluginRegistry()
    registered: dict[str, list[str]] = {}
    for slot in SLOT_HOOKS:
        for impl in registry.implementations(slot).values():
            registered.setdefault(impl.plugin, []).append(f"{slot} {impl.name}")
            impl.cls  # noqa: B018 — imports a class registered by reference
    for name in declared:
        assert registered.get(name), f"bundled plugin {name!r} registered nothing"
