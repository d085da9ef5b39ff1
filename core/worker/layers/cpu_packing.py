"""bf16 on CPU: every linear weight of a model laid out once for the kernels its measured
plan runs (kernel_choice.py), and the plan's table logged."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from plugserve.worker import cpu_linear, kernel_choice
from plugserve.worker.kernel_plan import KernelPlan
from plugserve.worker.layers.embedding import VocabParallelEmbedding
from plugserve.worker.layers.linear import Linear, RowParallelLinear
from plugserve.worker.layers.mlp import GatedMLP

logger = logging.getLogger(__name__)


@dataclass
class CpuPacking:
    """How a model's linears run: the plan, and the arena of cpu_gemm's copies (None where
    the plan never runs cpu_gemm)."""

    plan: KernelPlan
    arena: cpu_linear.WeightArena | None
    measurement: kernel_choice.Measurement


def pack_for_cpu(
    model: nn.Module, tied_head: VocabParallelEmbedding | None = None
) -> CpuPacking | None:
    """Where this machine packs the model's dtype (cpu_linear.packing_supported): choose
    the kernel plan (cached per machine and model shape, else measured on these weights),
    then pack every Linear and GatedMLP of `model` for it, and `tied_head` (an embedding
    that is also the LM head) as its head. cpu_gemm's copies lie in one arena in module
    order (a step's read order: layer by layer, qkv, o, gate-up, down), the tied head
    last. None where nothing packs."""
    weight = next(model.parameters())
    if not cpu_linear.packing_supported(weight.dtype, weight.device):
        return None
    steps = step_matmuls(model, tied_head)
    measurement = kernel_choice.plan_for(steps, coded=cpu_linear.coding_allowed())
    plan = measurement.plan
    log_plan(measurement)
    linears = [m.weight for m in model.modules() if isinstance(m, Linear)]
    arena = cpu_linear.WeightArena.for_weights(
        linears if tied_head is None else [*linears, tied_head.weight], plan
    )
    # modules() visits a GatedMLP before its linears: its pack reads their loaded weights,
    # which theirs then free.
    for module in model.modules():
        if isinstance(module, (Linear, GatedMLP)):
            module.pack(arena, plan)
    if tied_head is not None:
        tied_head.pack_as_head(arena, plan)
    return CpuPacking(plan, arena, measurement)


def step_matmuls(
    model: nn.Module, tied_head: VocabParallelEmbedding | None = None
) -> list[kernel_choice.Step]:
    """The matmuls of one step of `model`, in the order it runs them, as loaded (before
    packing): what the kernel choice times."""
    steps: list[kernel_choice.Step] = []
    in_mlp: set[int] = set()
    for module in model.modules():
        if isinstance(module, GatedMLP):
            gate_up, down = module.gate_up_proj, module.down_proj
            in_mlp.update((id(gate_up), id(down)))
            steps.append(
                kernel_choice.GatedMlpStep(gate_up.weight, down.weight, gate_up.bias, down.bias)
            )
        elif isinstance(module, Linear) and id(module) not in in_mlp:
            sharded = isinstance(module, RowParallelLinear) and module.parallel.world_size > 1
            bias = None if sharded else module.bias
            steps.append(
                kernel_choice.LinearStep(module.weight, bias, head=hasattr(module, "logits"))
            )
    if tied_head is not None:
        steps.append(kernel_choice.LinearStep(tied_head.weight, head=True))
    return steps


def log_plan(measurement: kernel_choice.Measurement) -> None:
    if not any(measurement.times_ms):
        logger.info(
            "bf16 linears: %s (unmeasured: set or the only kernels allowed)",
            measurement.plan.describe(),
        )
        return
    source = (
        f"measured before, cached in {measurement.cache_file}"
        if measurement.from_cache
        else f"measured now on {measurement.measured_bytes / 2**20:.0f} of "
        f"{measurement.total_bytes / 2**20:.0f} MiB of weights"
    )
    if measurement.others_share is not None:
        source += f", other processes using {100 * measurement.others_share:.0f}% of the CPUs"
    logger.info(
        "bf16 linear kernels by rows, ms for a step's matmuls, * chosen (%s):\n%s",
        source,
        measurement.table(),
    )
