"""How a parameter takes its values from a checkpoint tensor.

Each parameter a layer creates carries a weight loader, `loader(param, tensor, shard_id)`:
`tensor` is the full Hugging Face checkpoint tensor, and the loader copies the part this
tensor-parallel rank holds into its place in `param`. A fused parameter (several
checkpoint tensors stacked, as q/k/v in one qkv_proj) also declares the shard ids it is
made of, and takes each tensor with its shard id; every other parameter takes one tensor,
with shard id None. A parameter without a loader of its own (a norm's weight, replicated
on every rank) is copied whole (default_weight_loader).

Some checkpoints store a fused parameter's tensors already stacked in one (Phi-3's
qkv_proj and gate_up_proj). A fused parameter that declares its shards' full row counts
(`shard_sizes`) takes such a tensor too: the loading splits it into its shards and gives
each to the loader with its shard id, so each rank still takes its own part of every
shard (its heads' rows of q, of k and of v), not a slice of the stack.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

WeightLoader = Callable[[nn.Parameter, torch.Tensor, Any], None]


class WeightShapeError(ValueError):
    """A checkpoint tensor (this rank's part of it) does not fit its place."""

    def __init__(self, got: torch.Size, expected: torch.Size) -> None:
        super().__init__(f"has shape {tuple(got)}, expected {tuple(expected)}")
        self.got, self.expected = tuple(got), tuple(expected)


def copy_weight(dest: torch.Tensor, tensor: torch.Tensor) -> None:
    """dest[...] = tensor, refusing a shape that differs (no broadcasting)."""
    if dest.shape != tensor.shape:
        raise WeightShapeError(tensor.shape, dest.shape)
    dest.copy_(tensor)


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
    """The whole tensor: a parameter every rank holds in full."""
    copy_weight(param.data, tensor)


def set_weight_loader(
    param: nn.Parameter,
    loader: WeightLoader,
    shard_ids: Sequence[Any] | None = None,
    shard_sizes: Sequence[int] | None = None,
) -> None:
    """Attach `loader` to `param`; `shard_ids`, for a fused parameter, names the checkpoint
    tensors it is made of, in their order inside it, and `shard_sizes` their full
    (unsharded) row counts, where a checkpoint may hold them stacked in one tensor."""
    if shard_sizes is not None and (shard_ids is None or len(shard_sizes) != len(shard_ids)):
        raise ValueError("shard_sizes needs one row count per shard id")
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.shard_ids = None if shard_ids is None else tuple(shard_ids)  # type: ignore[attr-defined]
    param.shard_sizes = None if shard_sizes is None else tuple(shard_sizes)  # type: ignore[attr-defined]


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    return getattr(param, "weight_loader", default_weight_loader)


def shard_ids_of(param: nn.Parameter) -> tuple[Any, ...] | None:
    """The shard ids a fused parameter is loaded from; None for a parameter loaded whole."""
    return getattr(param, "shard_ids", None)


def shard_sizes_of(param: nn.Parameter) -> tuple[int, ...] | None:
    """A fused parameter's shards' full row counts, in shard_ids_of's order; None where
    the checkpoint must give each shard apart."""
    return getattr(param, "shard_sizes", None)
