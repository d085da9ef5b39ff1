"""engine.batch_invariant for the parts the model runner builds: the attention backend
asked to keep one reduction order (the linear methods are asked by their chooser,
linear_methods.py), and the layers no part can make invariant refused by name.

A request's greedy output then depends on the request alone: every sum over a row (a
matmul's over K, attention's over the context, a norm's over the hidden size) runs in the
same order whatever shares the step, however the prompt was chunked and after a
preemption's recompute. Parts that cannot say so are refused at start-up rather than run
a mode whose promise they would break.
"""

from __future__ import annotations

from torch import nn

from plugserve.capabilities import supports_batch_invariance
from plugserve.interfaces.model import AttentionBackend
from plugserve.worker.layers.moe import FusedMoE


def make_attention_batch_invariant(attention: AttentionBackend, name: str) -> None:
    """Ask the backend for one reduction order; ValueError naming it where it cannot."""
    if not supports_batch_invariance(attention):
        raise ValueError(
            f"engine.batch_invariant: attention backend {name!r} cannot keep a row's "
            "reductions in one order across batch sizes and chunkings"
        )
    attention.use_batch_invariant_order()


def refuse_batch_dependent_layers(model: nn.Module) -> None:
    """ValueError where a layer of `model` reduces in an order set by the batch: a
    mixture of experts multiplies each expert's weights by the rows routed to it, whose
    number (hence the matmul's algorithm) depends on every request in the step."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            raise ValueError(
                "engine.batch_invariant: this model's expert layers (FusedMoE) multiply "
                "each expert over the rows the step routes to it, in an order set by the "
                "batch; mixture-of-experts models are not supported in this mode"
            )
