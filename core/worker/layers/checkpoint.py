"""Loading a Hugging Face checkpoint through the parameters' weight loaders."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from plugserve.model_files import CheckpointError
from plugserve.worker.layers.linear import Linear
from plugserve.worker.layers.weight_loader import (
    WeightShapeError,
    shard_ids_of,
    shard_sizes_of,
    weight_loader_of,
)

# A checkpoint module name → (the fused module holding it, its shard id there), as
# {"q_proj": ("qkv_proj", "q"), "gate_proj": ("gate_up_proj", 0), ...}.
PackedModulesMapping = Mapping[str, tuple[str, Any]]
# A model's rule for names the mapping cannot express (a MoE expert's projection into
# its slice of a stacked weight): a checkpoint name → (our parameter name, its shard id),
# or None where the mapping decides.
WeightRoute = Callable[[str], tuple[str, Any] | None]


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: PackedModulesMapping,
    ignore: Callable[[str], bool] = lambda name: False,
    route: WeightRoute | None = None,
) -> None:
    """Copy HF-named tensors into `model`'s (partly fused) parameters, each through its
    weight loader; skip the names `ignore` accepts, and place a name by `route` where it
    says, else by the mapping. Raise on an unknown name, a wrong shape, and on
    parameters (or shards of a fused one) the checkpoint left unset."""
    if any(isinstance(m, Linear) and m.packed is not None for m in model.modules()):
        raise RuntimeError(
            "the linear weights were packed (process_weights_after_loading) and their "
            "loaded copies freed: load weights into a fresh model"
        )
    params = dict(model.named_parameters())
    loaded: set[tuple[str, Any]] = set()
    for name, tensor in weights:
        if ignore(name):
            continue
        routed = None if route is None else route(name)
        target, shard_id = routed or _fused_target(name, packed_modules_mapping)
        param = params.get(target)
        for part_id, part in _stacked_shards(name, tensor, param, shard_id):
            if param is None or part_id not in (shard_ids_of(param) or (None,)):
                raise CheckpointError(
                    f"checkpoint tensor {name!r} has no place in {type(model).__name__}"
                )
            try:
                weight_loader_of(param)(param, part, part_id)
            except WeightShapeError as error:
                raise CheckpointError(
                    f"checkpoint tensor {name!r} has shape {error.got}, expected {error.expected}"
                ) from None
            loaded.add((target, part_id))
    expected = {
        (name, shard_id)
        for name, param in params.items()
        for shard_id in (shard_ids_of(param) or (None,))
    }
    missing = sorted(
        name if shard_id is None else f"{name}[{shard_id}]" for name, shard_id in expected - loaded
    )
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")


def _stacked_shards(
    name: str, tensor: torch.Tensor, param: nn.Parameter | None, shard_id: Any
) -> list[tuple[Any, torch.Tensor]]:
    """The (shard id, tensor) pairs one checkpoint tensor loads as: itself, or, where it
    holds a fused parameter's shards already stacked (Phi-3's qkv_proj: q, k, v rows;
    its gate_up_proj: gate, up), each shard's rows, so every rank slices each shard."""
    sizes = None if param is None or shard_id is not None else shard_sizes_of(param)
    if sizes is None:
        return [(shard_id, tensor)]
    ids = shard_ids_of(param)
    assert ids is not None  # set_weight_loader gives sizes only with ids
    if tensor.shape[0] != sum(sizes):
        stacked = " + ".join(f"{shard} {size}" for shard, size in zip(ids, sizes, strict=True))
        raise CheckpointError(
            f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
            f"{sum(sizes)} ({stacked}, stacked)"
        )
    return list(zip(ids, tensor.split(list(sizes), dim=0), strict=True))


def _fused_target(name: str, packed_modules_mapping: PackedModulesMapping) -> tuple[str, Any]:
    """HF parameter name → (our parameter name, its shard id there, or None)."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in packed_modules_mapping:
        return name, None
    fused, shard_id = packed_modules_mapping[parts[-2]]
    return ".".join([*parts[:-2], fused, parts[-1]]), shard_id
