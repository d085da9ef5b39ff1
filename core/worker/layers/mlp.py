"""The gated MLP: down(act(gate(x)) * up(x)), gate and up in one matmul.

Activations by their transformers names: SiLU (Llama, Qwen, Mistral, ...) and GELU with
the tanh approximation (Gemma's gelu_pytorch_tanh).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.worker.layers.direct_call import direct_call
from plugserve.worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext

# transformers' ACT2FN name → the function, exactly as transformers computes it.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}
SUPPORTED_ACTIVATIONS = tuple(ACTIVATIONS)


@direct_call
class GatedMLP(nn.Module):
    """gate_up_proj column-parallel (this rank's slice of the intermediate dimension, for
    gate and up alike), down_proj row-parallel over the same slice."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        hidden_act: str = "silu",
        parallel: ParallelContext = NO_PARALLEL,
    ):
        super().__init__()
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {hidden_act!r} "
                f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
            )
        self.inter_start, self.inter_end = parallel.shard(intermediate_size)
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias, parallel
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, parallel)
        self.inter = self.inter_end - self.inter_start
        self.hidden_act = hidden_act
        self.act = ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x))."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
