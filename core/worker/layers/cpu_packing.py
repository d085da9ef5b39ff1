"""bf16 on CPU: every linear weight of a model packed once for the CPU kernel."""

from __future__ import annotations

from torch import nn

from plugserve.worker import cpu_linear
from plugserve.worker.layers.embedding import VocabParallelEmbedding
from plugserve.worker.layers.linear import Linear
from plugserve.worker.layers.mlp import GatedMLP


def pack_for_cpu(
    model: nn.Module, tied_head: VocabParallelEmbedding | None = None
) -> cpu_linear.WeightArena | None:
    """Where this machine packs the model's dtype (cpu_linear.packing_supported), pack
    every Linear and GatedMLP of `model`, and `tied_head` (an embedding that is also the
    LM head) as its head. The own kernel's copies lie in one arena, returned, in module
    order (a step's read order: layer by layer, qkv, o, gate-up, down) with the tied head
    last; None where there is no arena (oneDNN lays out its own, or nothing packs)."""
    weight = next(model.parameters())
    if not cpu_linear.packing_supported(weight.dtype, weight.device):
        return None
    linears = [m.weight for m in model.modules() if isinstance(m, Linear)]
    arena = cpu_linear.WeightArena.for_weights(
        linears if tied_head is None else [*linears, tied_head.weight]
    )
    # modules() visits a GatedMLP before its linears: its pack reads their loaded weights,
    # which theirs then free.
    for module in model.modules():
        if isinstance(module, (Linear, GatedMLP)):
            module.pack(arena)
    if tied_head is not None:
        tied_head.pack_as_head(arena)
    return arena
