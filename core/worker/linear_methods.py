"""Which linear method runs each linear layer of a model, and running each method's
processing once over all its layers.

The model runner builds a LinearMethodChooser from the stack and the device; the model
loader gives every Linear of the built model its method before the weights load
(`give_linear_methods`), and calls each method once after loading with all the layers it
was given, in module order (`process_linear_weights`), so that a method can lay the
weights of a whole model out together (the bf16 CPU method measures one kernel plan over
every matmul of a step and packs them into one buffer). Model files take no part: they
only wire layers.

`stack.linear_method` names one method for every layer; left unset, the dtype and the
device decide: the packed bf16 kernels for bf16 on a CPU, for fp32 on a CPU the reordered
oneDNN weights where they time faster than F.linear, the plain method (F.linear) elsewhere (config.AUTOMATIC_LINEAR_METHODS).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from plugserve.capabilities import has_tied_lm_head, supports_batch_invariance
from plugserve.config import AUTOMATIC_LINEAR_METHODS, StackConfig
from plugserve.interfaces.model import LinearMethod
from plugserve.plugins import PluginRegistry, get_registry
from plugserve.worker.layers.embedding import VocabParallelEmbedding
from plugserve.worker.layers.linear import Linear

logger = logging.getLogger(__name__)

SLOT = "linear_method"
PACKED_CPU_BF16, CPU_FP32, PLAIN = AUTOMATIC_LINEAR_METHODS


class LinearMethodChooser:
    """Picks the linear method of each layer: `selected` (stack.linear_method) for all of
    them, or, where None, PACKED_CPU_BF16 for bf16 on a CPU and CPU_FP32 for fp32 on one
    (either PLAIN where no plugin registers it) and PLAIN elsewhere. Each method is built once, from the registry with
    its block of `plugin_options`, and shared by the layers it runs. `batch_invariant`
    (engine.batch_invariant): each method is asked to keep one reduction order
    (capabilities.SupportsBatchInvariance) as it is built, and one that cannot is
    refused by name."""

    def __init__(
        self,
        *,
        dtype: torch.dtype,
        device: torch.device,
        selected: str | None = None,
        plugin_options: Mapping[str, Any] | None = None,
        registry: PluginRegistry | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.dtype, self.device = dtype, torch.device(device)
        self.batch_invariant = batch_invariant
        self.registry = registry or get_registry()
        self.plugin_options = dict(plugin_options or {})
        self.name = selected or self._automatic()
        self._built: dict[str, LinearMethod] = {}

    @classmethod
    def from_config(
        cls,
        config: StackConfig,
        dtype: torch.dtype,
        device: torch.device,
        registry: PluginRegistry | None = None,
    ) -> LinearMethodChooser:
        return cls(
            dtype=dtype,
            device=device,
            selected=config.stack.linear_method,
            plugin_options=config.plugins,
            registry=registry or get_registry(config.disabled_plugins),
            batch_invariant=config.engine.batch_invariant,
        )

    def _automatic(self) -> str:
        if self.device.type != "cpu":
            return PLAIN
        if self.dtype == torch.bfloat16:
            name = PACKED_CPU_BF16
        elif self.dtype == torch.float32:
            name = CPU_FP32
        else:
            return PLAIN
        if name not in self.registry.implementations(SLOT):
            logger.info("no %r linear method registered: linears run F.linear", name)
            return PLAIN
        return name

    def method_for(self, layer: nn.Module) -> LinearMethod:
        """The method of `layer` (a Linear, or an embedding that is also the LM head)."""
        return self._build(self.name)

    def _build(self, name: str) -> LinearMethod:
        if name not in self._built:
            options = self.plugin_options.get(name)
            method = self.registry.build(SLOT, name, dict(options or {}))
            if self.batch_invariant:
                if not supports_batch_invariance(method):
                    raise ValueError(
                        f"engine.batch_invariant: linear method {name!r} cannot keep a "
                        "row's sums in one order across batch sizes"
                        + (
                            " (bf16 on a CPU runs 'cpu_bf16', which can)"
                            if name in (PLAIN, CPU_FP32)
                            else ""
                        )
                    )
                method.use_batch_invariant_order()
            self._built[name] = method
        return self._built[name]


def give_linear_methods(model: nn.Module, chooser: LinearMethodChooser) -> None:
    """Give every Linear of the built `model` its method (creating the parameters the
    weights load into), and its tied LM head, where it has one, the head's."""
    for module in model.modules():
        if isinstance(module, Linear):
            method = chooser.method_for(module)
            if method is not module.method:
                module.use_method(method)
    head = _tied_head(model)
    if head is not None:
        head.head_method = chooser.method_for(head)


def process_linear_weights(model: nn.Module) -> list[LinearMethod]:
    """After loading: each method of `model`'s linears, once, with the layers it runs in
    module order, and the tied LM head where the head was given it. Returns the methods,
    in the order of their first layer."""
    groups = _layers_by_method(model)
    head = _tied_head(model)
    head_method = None if head is None else head.head_method
    if head_method is not None and id(head_method) not in groups:
        groups[id(head_method)] = (head_method, [])
    for method, layers in groups.values():
        method.process_weights_after_loading(
            layers, model=model, tied_head=head if method is head_method else None
        )
    return [method for method, _ in groups.values()]


def linear_methods_of(model: nn.Module) -> list[LinearMethod]:
    """The methods running `model`'s linears, in the order of their first layer."""
    return [method for method, _ in _layers_by_method(model).values()]


def _layers_by_method(model: nn.Module) -> dict[int, tuple[LinearMethod, list[Linear]]]:
    groups: dict[int, tuple[LinearMethod, list[Linear]]] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            groups.setdefault(id(module.method), (module.method, []))[1].append(module)
    return groups


def _tied_head(model: nn.Module) -> VocabParallelEmbedding | None:
    head = model.tied_lm_head() if has_tied_lm_head(model) else None
    return head if isinstance(head, VocabParallelEmbedding) else None
