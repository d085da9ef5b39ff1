"""Linear layers: tensor-parallel sharding, checkpoint loading and bf16 CPU packing.

- Linear: replicated (every rank holds the whole weight).
- ColumnParallelLinear: each rank holds a slice of the output rows (no collective; the
  next layer consumes the slice). MergedColumnParallelLinear stacks several such outputs
  (gate and up) in one matmul; QKVParallelLinear stacks q, k and v, sliced by heads.
- RowParallelLinear: each rank holds a slice of the input columns; the partial products
  are summed over ranks (all-reduce), then the full bias is added once.

Each layer's weight loader slices a full checkpoint tensor for its rank (weight_loader.py).
Without tensor parallelism every slice is the whole tensor and no collective runs.

bf16 on CPU, `pack` replaces the weight by a packed copy for the CPU kernel
(cpu_linear.PackedLinear) and frees the loaded one; `kernel` gives the cheapest callable
computing the layer (the packed weight, where no all-reduce must follow it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.worker import cpu_linear
from plugserve.worker.layers.direct_call import direct_call
from plugserve.worker.layers.weight_loader import copy_weight, set_weight_loader
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext


@direct_call
class Linear(nn.Module):
    """x @ weight.T + bias, the weight held whole on every rank; it may be packed once for
    the CPU kernel (cpu_linear)."""

    packed: cpu_linear.PackedLinear | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        shard_ids: Sequence[Any] | None = None,
        shard_sizes: Sequence[int] | None = None,
    ) -> None:
        """`shard_ids`: for a fused layer, the checkpoint tensors stacked in its weight;
        `shard_sizes`: their full row counts, so that a checkpoint holding them already
        stacked in one tensor (Phi-3's qkv_proj) loads too (weight_loader.py)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # Every weight is overwritten by the checkpoint: torch.empty skips initialization.
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        set_weight_loader(self.weight, self.weight_loader, shard_ids, shard_sizes)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(out_features))
            set_weight_loader(self.bias, self.weight_loader, shard_ids, shard_sizes)
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None
    ) -> None:
        copy_weight(param.data, tensor)

    def kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The cheapest callable computing this layer: the packed weight, else the module."""
        return self.packed if self.packed is not None else self

    def pack(
        self,
        arena: cpu_linear.WeightArena | None = None,
        plan: cpu_linear.KernelPlan | None = None,
    ) -> None:
        self._set_packed(cpu_linear.PackedLinear(self.weight, self.bias, arena, plan))

    def _set_packed(self, packed: cpu_linear.PackedLinear) -> None:
        """From now on the packed copy is the weight: the loaded one is freed, so a model
        does not hold its linear weights twice (an 8B model: 16 GB twice in bf16)."""
        self.packed = packed
        self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """Holds output rows [out_start, out_end) of the full layer, an even split over ranks."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        parallel: ParallelContext = NO_PARALLEL,
    ) -> None:
        start, end = parallel.shard(out_features)
        super().__init__(in_features, end - start, bias)
        self.out_start, self.out_end = start, end
        self.parallel = parallel

    def weight_loader(
        self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None
    ) -> None:
        copy_weight(param.data, tensor[self.out_start : self.out_end])


class MergedColumnParallelLinear(Linear):
    """Several column-parallel outputs stacked in one weight (gate and up: one matmul).
    Checkpoint tensor i (shard id i) is split evenly over ranks on its own, so each rank
    holds its slice of every output: [slice of output 0; slice of output 1; ...]."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        parallel: ParallelContext = NO_PARALLEL,
    ) -> None:
        ranges = [parallel.shard(size) for size in output_sizes]
        local_sizes = [end - start for start, end in ranges]
        super().__init__(
            in_features, sum(local_sizes), bias, range(len(output_sizes)), output_sizes
        )
        self.output_ranges = ranges  # this rank's rows [start, end) of each checkpoint tensor
        self.output_sizes = local_sizes  # their row counts, in the order they are stacked
        self.parallel = parallel

    def weight_loader(
        self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None
    ) -> None:
        start, end = self.output_ranges[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        copy_weight(param.data[offset : offset + end - start], tensor[start:end])


class QKVParallelLinear(Linear):
    """q, k and v projections stacked in one weight, each rank holding its heads' rows
    (parallel.head_shard: whole KV-head groups, or one replicated KV head). Checkpoint
    tensors: shard ids "q", "k", "v"."""

    SHARD_IDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        parallel: ParallelContext = NO_PARALLEL,
    ) -> None:
        heads = parallel.head_shard(num_heads, num_kv_heads)
        q_size, kv_size = heads.num_heads * head_dim, heads.num_kv_heads * head_dim
        full_kv = num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            q_size + 2 * kv_size,
            bias,
            self.SHARD_IDS,
            (num_heads * head_dim, full_kv, full_kv),
        )
        self.heads, self.head_dim = heads, head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.parallel = parallel

    def weight_loader(
        self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None
    ) -> None:
        heads, dim = self.heads, self.head_dim
        if shard_id == "q":
            offset, start, end = 0, heads.q_start * dim, heads.q_end * dim
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            start, end = heads.kv_start * dim, heads.kv_end * dim
        copy_weight(param.data[offset : offset + end - start], tensor[start:end])


@direct_call
class RowParallelLinear(Linear):
    """Holds input columns [in_start, in_end) of the full layer; the partial products are
    summed over ranks before the (full, unsharded) bias is added once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        parallel: ParallelContext = NO_PARALLEL,
        input_range: tuple[int, int] | None = None,
    ) -> None:
        """`input_range`: this rank's columns, where they are not an even split of
        in_features (attention's output projection: its heads' columns)."""
        start, end = input_range or parallel.shard(in_features)
        super().__init__(end - start, out_features, bias)
        self.in_start, self.in_end = start, end
        self.parallel = parallel

    def weight_loader(
        self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None
    ) -> None:
        if param is self.bias:  # added once, after the all-reduce: every rank holds it all
            copy_weight(param.data, tensor)
        else:
            copy_weight(param.data, tensor[:, self.in_start : self.in_end])

    def pack(
        self,
        arena: cpu_linear.WeightArena | None = None,
        plan: cpu_linear.KernelPlan | None = None,
    ) -> None:
        sharded = self.parallel.world_size > 1
        bias = None if sharded else self.bias
        self._set_packed(cpu_linear.PackedLinear(self.weight, bias, arena, plan))

    def kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        # Sharded, the partial products still need the all-reduce in forward.
        return super().kernel() if self.parallel.world_size == 1 else self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return super().forward(x)
        partial = F.linear(x, self.weight) if self.packed is None else self.packed(x)
        out = self.parallel.all_reduce(partial)
        return out if self.bias is None else out + self.bias
