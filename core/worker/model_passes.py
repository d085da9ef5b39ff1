"""The model passes a model load applies (interfaces.model.ModelPass), and the start-up
log of which path runs each layer and why.

The model runner builds the passes that `stack.model_passes` selects (`build_model_passes`;
None: the bundled automatic ones, config.AUTOMATIC_MODEL_PASSES, where registered) and
hands them to the model loader, which applies them in order once the linear methods
processed the weights (model_loader.finish_loading). A pass sees the model through its
decoder frame (interfaces.model.DecoderFrame: the layers, what the forward pass calls
per layer, the final norm, the rotary table, a whole-stack replacement) or its encoder
frame (interfaces.model.EncoderFrame: the layers, a whole-stack replacement) and
answers, per layer, whether it took it and what runs it now, or why it declined it.
Model files take no part: they only wire layers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from plugserve.config import AUTOMATIC_MODEL_PASSES, StackConfig
from plugserve.interfaces.model import DecoderFrame, EncoderFrame, LayerRoute, ModelPass
from plugserve.plugins import PluginRegistry, get_registry

logger = logging.getLogger(__name__)

SLOT = "model_pass"
# What runs a layer that no pass took: the modules the model file built.
GENERIC = "generic modules"


@dataclass(frozen=True)
class NamedPass:
    """A built pass and the name it was selected by (what the start-up log calls it)."""

    name: str
    model_pass: ModelPass


def build_model_passes(
    selected: Sequence[str] | None = None,
    plugin_options: Mapping[str, Any] | None = None,
    registry: PluginRegistry | None = None,
) -> list[NamedPass]:
    """The passes `selected` names, in order, each built from the registry with its block
    of `plugin_options`; None: those of AUTOMATIC_MODEL_PASSES that are registered."""
    registry = registry or get_registry()
    if selected is None:
        available = registry.implementations(SLOT)
        selected = [name for name in AUTOMATIC_MODEL_PASSES if name in available]
    options = dict(plugin_options or {})
    return [
        NamedPass(name, registry.build(SLOT, name, dict(options.get(name) or {})))
        for name in selected
    ]


def model_passes_from_config(
    config: StackConfig, registry: PluginRegistry | None = None
) -> list[NamedPass]:
    return build_model_passes(
        config.stack.model_passes,
        config.plugins,
        registry or get_registry(config.disabled_plugins),
    )


def apply_model_passes(model: nn.Module, passes: Sequence[NamedPass]) -> list[LayerRoute]:
    """Apply `passes` to `model` in order and log, once, which path runs each layer and
    why; returns that per layer (empty for a model without a decoder or encoder frame,
    which the passes cannot see into)."""
    if not isinstance(model, (DecoderFrame, EncoderFrame)):
        if passes:
            logger.info(
                "%s has no decoder or encoder frame (interfaces.model.DecoderFrame, "
                "EncoderFrame): no model pass applies, its forward runs its layers",
                type(model).__name__,
            )
        return []
    num_layers = len(model.layers)
    results: list[tuple[str, Sequence[LayerRoute]]] = []
    for named in passes:
        routes = list(named.model_pass.apply(model))
        if not routes and num_layers:
            continue  # a pass for the other kind of frame: it does not look at this model
        if len(routes) != num_layers:
            raise ValueError(
                f"model pass {named.name!r} returned {len(routes)} layer routes for "
                f"{num_layers} layers"
            )
        results.append((named.name, routes))
    routes = combine_routes(num_layers, results)
    logger.info(
        "%s, which path runs each layer (model passes: %s):\n%s",
        type(model).__name__,
        ", ".join(name for name, _ in results) or "none",
        describe_routes(routes),
    )
    return routes


def combine_routes(
    num_layers: int, results: Sequence[tuple[str, Sequence[LayerRoute]]]
) -> list[LayerRoute]:
    """Per layer, what the passes did to it, in order: the paths of those that took it
    (each with its why), else the generic modules and each pass's reason for declining."""
    combined = []
    for index in range(num_layers):
        taken = [routes[index] for _, routes in results if routes[index].taken]
        if taken:
            path = ", then ".join(route.path for route in taken)
            why = "; ".join(route.why for route in taken if route.why)
            combined.append(LayerRoute(True, path, why))
            continue
        declined = [f"{name}: {routes[index].why}" for name, routes in results]
        combined.append(LayerRoute(False, GENERIC, "; ".join(declined) or "no model pass"))
    return combined


def describe_routes(routes: Sequence[LayerRoute]) -> str:
    """One line per distinct route, its layers as ranges ("layers 0-2,5: fused bf16 CPU
    layer (why)"; "layers 3,4: generic modules: why"), in the order of their first layer."""
    groups: dict[str, list[int]] = {}
    for index, route in enumerate(routes):
        if route.taken:
            text = f"{route.path} ({route.why})" if route.why else route.path
        else:
            text = f"{route.path}: {route.why}"
        groups.setdefault(text, []).append(index)
    return "\n".join(
        f"  {'layer' if len(layers) == 1 else 'layers'} {index_ranges(layers)}: {text}"
        for text, layers in groups.items()
    )


def index_ranges(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] → "0-2,5,7,8": runs of three or more as ranges."""
    parts: list[str] = []
    start = previous = None
    for index in [*indices, None]:
        if previous is not None and index == previous + 1:
            previous = index
            continue
        if start is not None and previous is not None:
            if previous - start >= 2:
                parts.append(f"{start}-{previous}")
            else:
                parts += [str(i) for i in range(start, previous + 1)]
        start = previous = index
    return ",".join(parts)
