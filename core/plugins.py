"""The plugin manager: discovers plugins and resolves stack.yaml names to classes.

Plugins are found through the `plugserve` entry-point group; the bundled ones in
`plugserve_plugins` register exactly the same way, the core imports none of them. Each
slot hook is called once per plugin with a `register(name, cls)` callback bound to that
plugin's distribution, so that two distributions claiming one name fail naming both.

Loading is lazy, idempotent and happens again in every spawned process.
`PLUGSERVE_PLUGIN_MODULES` (comma-separated module names) registers plugin modules that
no distribution declares, like pytest's `-p module`.
`PLUGSERVE_PLUGINS` (comma-separated entry-point names) keeps only those third-party
plugins; `plugins.disable` in stack.yaml (or `disable=` here) blocks named ones, like
pytest's `-p no:name`.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from plugserve import hookspecs

ENTRY_POINT_GROUP = "plugserve"

# slot name (as in stack.yaml's `stack:` block) -> the hook that fills it
SLOT_HOOKS: dict[str, str] = {
    "renderer": "register_renderers",
    "detokenizer": "register_detokenizers",
    "tool_parser": "register_tool_parsers",
    "reasoning_parser": "register_reasoning_parsers",
    "transport": "register_transports",
    "scheduler": "register_scheduler_policies",
    "kv_allocator": "register_kv_allocators",
    "structured_output": "register_structured_output_backends",
    "executor": "register_executors",
    "spec_proposer": "register_spec_proposers",
    "attention": "register_attention_backends",
    "linear_method": "register_linear_methods",
    "model_pass": "register_model_passes",
    "pooler": "register_poolers",
    "model": "register_models",
}

BUILTIN_DISTRIBUTION = "plugserve"


class PluginError(ValueError):
    """A plugin name that cannot be resolved, or two plugins claiming one name."""


@dataclass(frozen=True)
class Implementation:
    slot: str
    name: str
    # The class, or a "module:Class" reference to it, imported on first use of `cls`: a
    # process that never builds the implementation (the API server and the model code)
    # never imports its module.
    target: type | str
    distribution: str  # the installed distribution that registered it
    plugin: str  # the entry-point (or module) name

    @property
    def reference(self) -> str:
        """Where the implementation lives, as "module:Class", without importing it (a
        listing of model architectures must not import torch and every model module)."""
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"

    @property
    def cls(self) -> type:
        if isinstance(self.target, type):
            return self.target
        module_name, _, attribute = self.target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise PluginError(
                f"{self.slot} {self.name!r} from plugin {self.plugin!r}: "
                f"cannot import {self.target!r}: {exc}"
            ) from exc
        object.__setattr__(self, "target", cls)  # resolved once
        return cls


class PluginRegistry:
    """A typed facade over pluggy's PluginManager; the only place that calls hooks."""

    def __init__(self, disable: Iterable[str] = ()) -> None:
        self._pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self._pm.add_hookspecs(hookspecs)
        self._disable = set(disable)
        self._slots: dict[str, dict[str, Implementation]] | None = None
        self._dist_of_plugin: dict[str, str] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- discovery

    def load(self) -> None:
        with self._lock:
            if self._slots is not None:
                return
            self._register_builtins()
            self._load_entry_points()
            self._load_named_modules()
            try:
                self._pm.check_pending()
            except pluggy.PluginValidationError as exc:
                raise PluginError(f"{exc} (is the plugin written for this plugserve?)") from exc
            self._slots = self._collect()

    def register(self, plugin: ModuleType | object, name: str, distribution: str) -> None:
        """Register a plugin object directly (tests, embedding applications). Must happen
        before the first lookup."""
        if self._slots is not None:
            raise RuntimeError("plugins are already loaded; register before the first lookup")
        self._pm.register(plugin, name=name)
        self._dist_of_plugin[name] = distribution

    def _register_builtins(self) -> None:
        # What ships inside the core itself: the model architectures and the plain linear
        # method (by reference: loading the registry imports no worker code) and the API
        # server's endpoints (their route modules imported only when an API server builds
        # its app).
        from plugserve import builtin_linear_methods, builtin_models
        from plugserve.frontend import routes as builtin_routes

        for name, module in (
            ("plugserve.models", builtin_models),
            ("plugserve.linear_methods", builtin_linear_methods),
            ("plugserve.routes", builtin_routes),
        ):
            if not self._pm.is_registered(module):
                self._pm.register(module, name=name)
                self._dist_of_plugin[name] = BUILTIN_DISTRIBUTION

    def _load_named_modules(self) -> None:
        # Like pytest's `-p module`: plugins from importable modules that no distribution
        # declares (a test's plugin, a local experiment). Spawned engine processes inherit
        # the environment, so they load the same ones.
        names = os.environ.get("PLUGSERVE_PLUGIN_MODULES", "")
        for module_name in (n.strip() for n in names.split(",") if n.strip()):
            if self._pm.has_plugin(module_name):
                continue
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                raise PluginError(
                    f"plugin module {module_name!r} (PLUGSERVE_PLUGIN_MODULES) failed to import: {exc}"
                ) from exc
            self._pm.register(module, name=module_name)
            self._dist_of_plugin[module_name] = f"<module {module_name}>"

    def _load_entry_points(self) -> None:
        allow = os.environ.get("PLUGSERVE_PLUGINS")
        allowed = {n.strip() for n in allow.split(",") if n.strip()} if allow else None
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        # Bundled plugins first, third-party after, so listings read in that order.
        ordered = sorted(
            entry_points,
            key=lambda ep: (_distribution_name(ep) != BUILTIN_DISTRIBUTION, ep.name),
        )
        for ep in ordered:
            dist = _distribution_name(ep)
            if ep.name in self._disable or self._pm.has_plugin(ep.name):
                continue
            if allowed is not None and dist != BUILTIN_DISTRIBUTION and ep.name not in allowed:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must say who it is
                raise PluginError(
                    f"plugin {ep.name!r} from distribution {dist!r} failed to import: {exc}"
                ) from exc
            self._pm.register(plugin, name=ep.name)
            self._dist_of_plugin[ep.name] = dist

    def _collect(self) -> dict[str, dict[str, Implementation]]:
        slots: dict[str, dict[str, Implementation]] = {slot: {} for slot in SLOT_HOOKS}
        for slot, hook_name in SLOT_HOOKS.items():
            caller = getattr(self._pm.hook, hook_name)
            # get_hookimpls() is in registration order: bundled plugins first.
            for impl in caller.get_hookimpls():
                dist = self._dist_of_plugin.get(impl.plugin_name, "<unknown>")
                registry = slots[slot]

                def register(
                    name: str,
                    cls: type | str,
                    *,
                    _slot: str = slot,
                    _dist: str = dist,
                    _plugin: str = impl.plugin_name,
                    _registry: dict[str, Implementation] = registry,
                ) -> None:
                    if not isinstance(name, str) or not name:
                        raise PluginError(f"plugin {_plugin!r} registered a {_slot} without a name")
                    if isinstance(cls, str) and ":" not in cls:
                        raise PluginError(
                            f"plugin {_plugin!r} registered {_slot} {name!r} as {cls!r}; "
                            "a reference reads 'module:Class'"
                        )
                    existing = _registry.get(name)
                    if existing is not None and existing.target != cls:
                        raise PluginError(
                            f"two plugins claim the {_slot} name {name!r}: "
                            f"{existing.plugin!r} from distribution {existing.distribution!r} "
                            f"and {_plugin!r} from distribution {_dist!r}"
                        )
                    _registry[name] = Implementation(_slot, name, cls, _dist, _plugin)

                impl.function(register=register)
        return slots

    # ----------------------------------------------------------------- lookup

    def implementations(self, slot: str) -> dict[str, Implementation]:
        self.load()
        assert self._slots is not None
        if slot not in self._slots:
            raise PluginError(f"unknown slot {slot!r}; slots: {', '.join(SLOT_HOOKS)}")
        return dict(self._slots[slot])

    def get(self, slot: str, name: str) -> type:
        impls = self.implementations(slot)
        if name not in impls:
            available = ", ".join(sorted(impls)) or "none installed"
            raise PluginError(f"unknown {slot} {name!r}; available: {available}")
        return impls[name].cls

    def build(self, slot: str, name: str, options: dict[str, Any] | None = None, **kwargs: Any):
        """Construct the named implementation. A class that declares `Options` (a pydantic
        model) gets `options=` validated from its block in stack.yaml."""
        cls = self.get(slot, name)
        options_model = getattr(cls, "Options", None)
        if options_model is not None:
            kwargs["options"] = options_model.model_validate(options or {})
        elif options:
            raise PluginError(f"{slot} {name!r} takes no options, got: {', '.join(options)}")
        return cls(**kwargs)

    @property
    def hook(self) -> Any:
        """Observer hooks (request_finished, engine_step_finished) for the engine to call."""
        self.load()
        return self._pm.hook

    def register_metrics(self, registry: Any, model_name: str) -> None:
        """Let every plugin add its metrics to an API server's /metrics (hookspecs)."""
        self.load()
        self._pm.hook.register_metrics(registry=registry, model_name=model_name)

    def register_routes(self, server_for: Callable[[str, str], Any]) -> None:
        """Let every plugin add endpoints to an API server (hookspecs), the bundled ones
        first: each plugin's hook gets `server_for(plugin, distribution)`, an ApiServer
        bound to that plugin, so that a route two plugins claim is blamed on both."""
        self.load()
        # Registration order, in which a plugin registered directly precedes the builtins.
        impls = sorted(
            self._pm.hook.register_routes.get_hookimpls(),
            key=lambda impl: self._distribution(impl.plugin_name) != BUILTIN_DISTRIBUTION,
        )
        for impl in impls:
            dist = self._distribution(impl.plugin_name)
            impl.function(server=server_for(impl.plugin_name, dist))

    def _distribution(self, plugin: str) -> str:
        return self._dist_of_plugin.get(plugin, "<unknown>")

    def has_observers(self, hook_name: str) -> bool:
        self.load()
        return bool(getattr(self._pm.hook, hook_name).get_hookimpls())


def _distribution_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else "<unknown>"


_registry: PluginRegistry | None = None
_registry_lock = threading.Lock()


def get_registry(disable: Iterable[str] = ()) -> PluginRegistry:
    """The process-wide registry, created on first use (again if `disable` changes)."""
    global _registry
    with _registry_lock:
        if _registry is None or _registry._disable != set(disable):
            _registry = PluginRegistry(disable)
        return _registry


def set_registry(registry: PluginRegistry | None) -> PluginRegistry | None:
    """Install a registry as the process-wide one (an application embedding plugserve
    with plugins it registers itself, or a test); returns the previous one."""
    global _registry
    with _registry_lock:
        previous, _registry = _registry, registry
        return previous
