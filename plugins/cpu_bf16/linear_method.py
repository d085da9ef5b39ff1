"""bf16 on CPU: every linear weight of a model laid out once for the kernels its measured
plan runs (kernel_choice.py), and the plan's table logged.

The layers load the checkpoint's weights as the plain method does. After loading, the
method, given all its layers at once, chooses the plan (cached per machine and model
shape, else timed on these weights: every matmul of a step, each gated MLP as one), then
packs every layer for it (packed_linear.PackedLinear), and the tied LM head as a head.
cpu_gemm's copies lie in one arena in module order (a step's read order: layer by layer,
qkv, o, gate-up, down), the tied head last. Where the plan runs some prefill chunks' MLPs
as oneDNN post-ops, each gated MLP's gate, up and down weights are also packed for that
(fused_mlp.FusedMLP), which the fused decoder layer runs (fused_layer.py). Where this
machine packs no weight of the model's dtype (fp32, a CPU without bf16 matmuls), the
layers keep F.linear.

The option `coded_weights` (on by default) lets one-row matmuls read a lossless
exponent-coded copy of each weight (exponent_coding.py: 12 bits a weight instead of 16;
the same results bit for bit), held beside the plain packed copy; whether they do is
measured with the other kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from plugserve.interfaces.model import LinearLayer, TiedLmHead
from plugserve.worker.layers.mlp import GatedMLP
from plugserve.worker.layers.plain_linear import PlainLinearMethod
from plugserve_plugins.cpu_bf16 import kernel_choice
from plugserve_plugins.cpu_bf16.cpu_features import row_pool_enabled
from plugserve_plugins.cpu_bf16.fused_mlp import FusedMLP
from plugserve_plugins.cpu_bf16.kernel_plan import TILED, KernelPlan
from plugserve_plugins.cpu_bf16.packed_linear import (
    PackedLinear,
    pack_onednn,
    packing_supported,
)
from plugserve_plugins.cpu_bf16.weight_arena import WeightArena

logger = logging.getLogger(__name__)


@dataclass
class CpuPacking:
    """How a model's linears run: the plan, the arena of cpu_gemm's copies (None where
    the plan never runs cpu_gemm), and each gated MLP's oneDNN post-op form, by the
    MLP's id, where the plan runs prefill chunks' MLPs that way."""

    plan: KernelPlan
    arena: WeightArena | None
    measurement: kernel_choice.Measurement
    fused_mlps: dict[int, FusedMLP]


class PackedCpuBf16(PlainLinearMethod):
    """interfaces.model.LinearMethod: bf16 weights packed for the CPU kernels of a measured plan
    (capabilities: HasKernelPlan, SupportsWeightBuffer, DescribesLinears,
    SupportsBatchInvariance)."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        # One-row matmuls may read exponent-coded copies of the packed weights.
        coded_weights: bool = True
        # The least share of a bucket's time a further copy of the weights (a kernel's
        # own layout: exponent-coded, oneDNN's, the fused MLP's) must save to be kept;
        # 0: each row count's fastest kernel, whatever the copies cost in memory.
        layout_gain: float = Field(0.05, ge=0)

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or self.Options()
        self.packing: CpuPacking | None = None
        self.batch_invariant = False

    def use_batch_invariant_order(self) -> None:
        """Run every row count on one kernel whose rows do not depend on each other
        (kernel_plan.BATCH_INVARIANT_KERNELS, the faster here where two run); a ValueError
        where none runs on this machine."""
        kernel_choice.batch_invariant_candidates()
        self.batch_invariant = True

    @property
    def kernel_plan(self) -> KernelPlan | None:
        return None if self.packing is None else self.packing.plan

    @property
    def kernel_measurement(self) -> kernel_choice.Measurement | None:
        return None if self.packing is None else self.packing.measurement

    def weight_buffer(self) -> torch.Tensor | None:
        """cpu_gemm's packed weights, in one buffer (None where the plan runs none)."""
        arena = None if self.packing is None else self.packing.arena
        return None if arena is None else arena.packed()

    def describe(self) -> str:
        if self.packing is None:
            return "bf16 linears: as the model runs them (no kernel plan)"
        return f"bf16 linears: {describe_bf16_path(self.packing.plan)}"

    def fused_mlp(self, mlp: nn.Module) -> FusedMLP | None:
        """`mlp`'s oneDNN post-op form (for the buckets whose kernel has fused_mlp), where
        this method built one: a SiLU GatedMLP without biases on one rank."""
        return None if self.packing is None else self.packing.fused_mlps.get(id(mlp))

    def process_weights_after_loading(
        self,
        layers: Sequence[LinearLayer],
        *,
        model: nn.Module,
        tied_head: TiedLmHead | None,
    ) -> None:
        weights = [layer.weight for layer in layers]  # type: ignore[attr-defined]
        if tied_head is not None:
            weights.append(tied_head.weight)
        if not weights or not packing_supported(weights[0].dtype, weights[0].device):
            if self.batch_invariant:
                raise ValueError(
                    f"engine.batch_invariant: linear method 'cpu_bf16' packs no "
                    f"{weights[0].dtype if weights else 'model'} weight on this machine"
                )
            return
        steps = step_matmuls(model, layers, tied_head)
        measurement = kernel_choice.plan_for(
            steps,
            coded=self.options.coded_weights,
            batch_invariant=self.batch_invariant,
            layout_gain=self.options.layout_gain,
        )
        plan = measurement.plan
        log_plan(measurement)
        arena = WeightArena.for_weights(weights, plan)
        owned = {id(layer) for layer in layers}
        packed: dict[int, PackedLinear] = {}
        # The gate and up halves of each fusing MLP, blocked for oneDNN before packing
        # frees the loaded gate-up weight (modules() visits a GatedMLP before its linears).
        fusing: list[tuple[GatedMLP, torch.Tensor, torch.Tensor]] = []
        for module in model.modules():
            if isinstance(module, GatedMLP) and _owns_mlp(owned, module):
                if plan.fused_mlp and _fuses(module):
                    gate_up = module.gate_up_proj.weight
                    fusing.append(
                        (
                            module,
                            pack_onednn(gate_up[: module.inter].contiguous()),
                            pack_onednn(gate_up[module.inter :].contiguous()),
                        )
                    )
            elif id(module) in owned:
                layer: LinearLayer = module  # type: ignore[assignment]
                weight = layer.weight  # type: ignore[attr-defined]
                packed[id(module)] = PackedLinear(weight, layer.matmul_bias, arena, plan)
                layer.install(packed[id(module)])
        if tied_head is not None:
            tied_head.install_head(PackedLinear(tied_head.weight, arena=arena, plan=plan))
        # Each fused MLP's down projection: its PackedLinear's oneDNN copy (a plan with a
        # fused-MLP bucket runs oneDNN, so every PackedLinear of it holds one).
        fused_mlps = {
            id(mlp): FusedMLP(gate, up, _onednn_copy(packed[id(mlp.down_proj)]))
            for mlp, gate, up in fusing
        }
        self.packing = CpuPacking(plan, arena, measurement, fused_mlps)


def step_matmuls(
    model: nn.Module, layers: Sequence[LinearLayer], tied_head: TiedLmHead | None = None
) -> list[kernel_choice.Step]:
    """The matmuls of one step of `model` that `layers` run, in the order the model runs
    them, as loaded (before packing): what the kernel choice times."""
    owned = {id(layer) for layer in layers}
    steps: list[kernel_choice.Step] = []
    in_mlp: set[int] = set()
    for module in model.modules():
        if isinstance(module, GatedMLP) and _owns_mlp(owned, module):
            gate_up, down = module.gate_up_proj, module.down_proj
            in_mlp.update((id(gate_up), id(down)))
            steps.append(
                kernel_choice.GatedMlpStep(gate_up.weight, down.weight, gate_up.bias, down.bias)
            )
        elif id(module) in owned and id(module) not in in_mlp:
            layer: LinearLayer = module  # type: ignore[assignment]
            steps.append(
                kernel_choice.LinearStep(
                    layer.weight,  # type: ignore[attr-defined]
                    layer.matmul_bias,
                    head=hasattr(module, "logits"),
                )
            )
    if tied_head is not None:
        steps.append(kernel_choice.LinearStep(tied_head.weight, head=True))
    return steps


def _owns_mlp(owned: set[int], mlp: GatedMLP) -> bool:
    return id(mlp.gate_up_proj) in owned and id(mlp.down_proj) in owned


def _fuses(mlp: GatedMLP) -> bool:
    """Whether oneDNN's post-ops compute this MLP: SiLU (its only gated activation), whole
    on this rank (a shard's down_proj needs its all-reduce), without biases."""
    return (
        mlp.hidden_act == "silu"
        and mlp.down_proj.parallel.world_size == 1
        and mlp.gate_up_proj.bias is None
        and mlp.down_proj.bias is None
    )


def _onednn_copy(linear: PackedLinear) -> torch.Tensor:
    if linear.onednn_weight is None:
        raise RuntimeError("a plan with a fused-MLP bucket packs every weight for oneDNN")
    return linear.onednn_weight


def describe_bf16_path(plan: KernelPlan) -> str:
    """One line for the start-up log: which kernel each row bucket runs, and whether
    one-row steps share their work with the row pool's helper thread (which also needs
    more than one torch thread)."""
    line = f"{plan.describe()}; weights held as {', '.join(sorted(plan.layouts()))}"
    one_row = plan.by_bucket[0]
    if one_row.library == "own" and one_row.one_row_mode != TILED:
        pool = row_pool_enabled() and torch.get_num_threads() > 1
        line += "; one-row cpu_gemm steps " + (
            "shared with the helper thread" if pool else "on the calling threads only"
        )
    return line


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
