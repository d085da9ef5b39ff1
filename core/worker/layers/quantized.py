"""Weight quantization (stack.quantization): every linear of a loaded model replaced by the
selected method's quantized callable, instead of packing it for the bf16 CPU kernels.

The model runner selects the method around load_model (`quantizing`); the model's weight
post-processing (DecoderForCausalLM.pack_linears) then asks `current_method()` and, where
one is set, calls `quantize_linears`. Each Linear's `packed` becomes the callable (so
`forward` and `kernel()` run it), the LM head's too, tied or not (the embedding lookup
keeps its rows). Without a kernel plan or cpu_gemm-packed weights, the fused CPU decoder
and GatedMLP's oneDNN path decline on their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from torch import nn

from plugserve.interfaces import WeightQuantization
from plugserve.worker.layers.embedding import VocabParallelEmbedding
from plugserve.worker.layers.linear import Linear, RowParallelLinear


@dataclass
class Quantizing:
    """The method in force while a model loads, and how many weights it quantized (the
    runner refuses a model whose post-processing quantized none)."""

    name: str
    method: WeightQuantization
    quantized: int = 0


_CURRENT: ContextVar[Quantizing | None] = ContextVar("plugserve_quantization", default=None)


@contextmanager
def quantizing(name: str, method: WeightQuantization) -> Iterator[Quantizing]:
    """Within this block, models quantize their linears with `method` after loading."""
    state = Quantizing(name, method)
    token = _CURRENT.set(state)
    try:
        yield state
    finally:
        _CURRENT.reset(token)


def current_method() -> Quantizing | None:
    return _CURRENT.get()


def quantize_linears(
    model: nn.Module, state: Quantizing, tied_head: VocabParallelEmbedding | None = None
) -> None:
    """Replace every Linear's weight in `model` by `state.method`'s callable, and give
    `tied_head` (an embedding that is also the LM head) one as its head; the loaded
    linear weights are freed."""
    for module in list(model.modules()):
        if isinstance(module, Linear):
            # A row-parallel shard adds its bias after the all-reduce, in forward.
            sharded = isinstance(module, RowParallelLinear) and module.parallel.world_size > 1
            bias = None if sharded else module.bias
            module._set_packed(state.method.quantize(module.weight.detach(), bias))
            state.quantized += 1
    if tied_head is not None:
        tied_head.packed_head = state.method.quantize(tied_head.weight.detach())
        state.quantized += 1
