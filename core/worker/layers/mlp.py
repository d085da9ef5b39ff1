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

from plugserve.worker import cpu_linear
from plugserve.worker.kernel_plan import KernelPlan
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
        self.fused: cpu_linear.FusedMLP | None = None
        self.plan: KernelPlan | None = None  # where packed: which row counts run `fused`

    def pack(
        self,
        arena: cpu_linear.WeightArena | None = None,
        plan: cpu_linear.KernelPlan | None = None,
    ) -> None:
        """Where `plan` runs some prefill chunks' MLP as oneDNN post-ops, pack gate and up
        apart for it (cpu_linear.FusedMLP). (`arena` is for cpu_gemm's layout, which never
        runs this path.) Reads the loaded weights: runs before gate_up_proj and down_proj
        are packed."""
        self.plan = plan or cpu_linear.default_plan()
        if (
            self.plan.fused_mlp
            and self.hidden_act == "silu"  # oneDNN's post-op is SiLU
            and self.down_proj.parallel.world_size == 1
            and self.gate_up_proj.bias is None
        ):
            self.fused = cpu_linear.FusedMLP(
                self.gate_up_proj.weight[: self.inter],
                self.gate_up_proj.weight[self.inter :],
                self.down_proj.weight,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x))."""
        if (
            self.fused is not None
            and self.plan is not None
            and self.plan.for_rows(x.shape[0]).fused_mlp
        ):
            return self.fused(x)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
