"""Linear layers: tensor-parallel sharding, checkpoint loading, and the linear method that
holds and multiplies each layer's weight.

- Linear: replicated (every rank holds the whole weight).
- ColumnParallelLinear: each rank holds a slice of the output rows (no collective; the
  next layer consumes the slice). MergedColumnParallelLinear stacks several such outputs
  (gate and up) in one matmul; QKVParallelLinear stacks q, k and v, sliced by heads.
- RowParallelLinear: each rank holds a slice of the input columns; the partial products
  are summed over ranks (all-reduce), then the full bias is added once.

Each layer's weight loader slices a full checkpoint tensor for its rank (weight_loader.py)
and hands the slice to the layer's method to write. Without tensor parallelism every slice
is the whole tensor and no collective runs.

A layer is built with the plain method (plain_linear.py); the model loader may give
it another before loading (worker/linear_methods.py: the packed bf16 CPU kernels, int8
weights, a plugin's). After loading, a method may `install` a callable in the layer's
place (`packed`: a packed or quantized weight), which forward then calls; `kernel` gives
the cheapest callable computing the layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from plugserve.interfaces.model import LinearCompute, LinearMethod
from plugserve.worker.layers.direct_call import direct_call
from plugserve.worker.layers.plain_linear import PlainLinearMethod
from plugserve.worker.layers.weight_loader import WeightShapeError, set_weight_loader
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext

# Stateless: one instance serves every layer that keeps the plain method.
PLAIN_METHOD = PlainLinearMethod()


@direct_call
class Linear(nn.Module):
    """x @ weight.T + bias, the weight held whole on every rank, through the layer's linear
    method (interfaces.model.LinearMethod; the plain one until the loader gives another)."""

    # What the method installed in the layer's place (a packed or quantized weight), once
    # processed: called as (x, out_dtype=None).
    packed: LinearCompute | None = None

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
        self.has_bias = bias
        self._shard_ids, self._shard_sizes = shard_ids, shard_sizes
        self.use_method(PLAIN_METHOD)

    def use_method(self, method: LinearMethod) -> None:
        """Run this layer by `method` from now on: the parameters of the previous one are
        dropped and `method` creates its own (before the weights load)."""
        for name in list(self._parameters):
            del self._parameters[name]
        self.method: LinearMethod = method
        method.create_weights(self)
        if "bias" not in self._parameters:  # a layer without one, or a method keeping none
            self.register_parameter("bias", None)

    def add_parameter(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
    ) -> nn.Parameter:
        # torch.empty: every parameter is overwritten by the checkpoint.
        data = torch.empty(shape, dtype=dtype)
        param = nn.Parameter(data, requires_grad=data.is_floating_point())
        set_weight_loader(param, self.weight_loader, self._shard_ids, self._shard_sizes)
        setattr(self, name, param)
        return param

    @property
    def matmul_bias(self) -> torch.Tensor | None:
        return self.bias

    def weight_loader(
        self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None
    ) -> None:
        self.load_into(param, param.data, tensor)

    def load_into(
        self, param: nn.Parameter, destination: torch.Tensor, loaded: torch.Tensor
    ) -> None:
        """`loaded` (this rank's part of a checkpoint tensor) into `destination`, its place
        in `param`, written by the method; a shape that differs is refused."""
        if destination.shape != loaded.shape:
            raise WeightShapeError(loaded.shape, destination.shape)
        self.method.load_weight(self, param, destination, loaded)

    def install(self, compute: LinearCompute) -> None:
        """From now on `compute` is the layer's matmul: the loaded parameters are freed, so
        a model does not hold its linear weights twice. The bias stays, for a row-parallel
        shard that adds it after the all-reduce."""
        self.packed = compute
        for name, param in self.named_parameters(recurse=False):
            if name != "bias":
                param.data = param.data.new_empty(0)

    def kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The cheapest callable computing this layer: what the method installed, else the
        module."""
        return self.packed if self.packed is not None else self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return self.method.apply(self, x)


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
        self.load_into(param, param.data, tensor[self.out_start : self.out_end])


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
        self.load_into(param, param.data[offset : offset + end - start], tensor[start:end])


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
        self.load_into(param, param.data[offset : offset + end - start], tensor[start:end])


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
            self.load_into(param, param.data, tensor)
        else:
            self.load_into(param, param.data, tensor[:, self.in_start : self.in_end])

    @property
    def matmul_bias(self) -> torch.Tensor | None:
        # Sharded, the bias is added once, after the partial products are summed.
        return self.bias if self.parallel.world_size == 1 else None

    def kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        # Sharded, the partial products still need the all-reduce in forward.
        return super().kernel() if self.parallel.world_size == 1 else self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return super().forward(x)
        partial = self.method.apply(self, x) if self.packed is None else self.packed(x)
        out = self.parallel.all_reduce(partial)
        return out if self.bias is None else out + self.bias
