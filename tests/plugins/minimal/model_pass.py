"""A third-party model pass, a small real one: each decoder layer of the loaded model runs
inside `torch.profiler.record_function("layer <i>")`, so a profiler trace of the engine
shows one span per layer (and the kernels each ran under it) instead of one flat run of
ops. It changes no number: every span calls what ran there before it, the fused bf16 CPU
layers included; where a pass before it installed a whole-stack replacement, the steps
that run it show one "decoder stack" span; an encoder it leaves alone (no routes). Written
against plugserve.interfaces (ModelPass and the DecoderFrame it is given) and `hookimpl`
only.

Loaded through PLUGSERVE_PLUGIN_MODULES=tests.plugins.minimal.model_pass;
tests/plugins/test_minimal_plugins.py selects it (stack.model_passes: [layer_spans]).
"""

from __future__ import annotations

from typing import Any

import torch

from plugserve import hookimpl
from plugserve.hookspecs import Register
from plugserve.interfaces.model import DecoderFrame, EncoderFrame, LayerRoute, WholeStack


class Span:
    """`run`, called inside a profiler span named `name`."""

    def __init__(self, name: str, run: Any) -> None:
        self.name, self.run = name, run

    def __call__(self, *args: Any) -> Any:
        with torch.profiler.record_function(self.name):
            return self.run(*args)


class StackSpan(Span):
    """A whole-stack replacement (interfaces.model.WholeStack) inside one span."""

    def __init__(self, stack: WholeStack) -> None:
        super().__init__("decoder stack", stack)
        self.runs = stack.runs


class LayerSpans:
    """interfaces.model.ModelPass: a profiler span around every layer."""

    def apply(self, model: DecoderFrame | EncoderFrame) -> list[LayerRoute]:
        if not isinstance(model, DecoderFrame):
            return []  # an encoder: this pass looks at decoders only
        for index, layer in enumerate(model.layer_fns):
            model.layer_fns[index] = Span(f"layer {index}", layer)
        if model.whole_stack is not None:
            model.install_stack(StackSpan(model.whole_stack))
        return [
            LayerRoute(True, "in a profiler span", f"record_function 'layer {index}'")
            for index in range(len(model.layers))
        ]


@hookimpl
def register_model_passes(register: Register) -> None:
    register("layer_spans", LayerSpans)
