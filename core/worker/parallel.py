"""Tensor- and pipeline-parallel state, collectives, shard ranges and stage ranges.

Under pipeline parallelism ranks are laid out stage-major (datatypes/pipeline_stage.py's
RankLayout): a stage's tensor-parallel ranks are consecutive, each stage has its own
group for its collectives, and rank j of stage k sends its activations to rank j of
stage k + 1 point to point (PipelineLink); after a stage's all-reduces its hidden states
are whole on every rank, so each pair carries the same.

A model built without a ParallelContext (or with `NO_PARALLEL`) runs every collective as
a no-op and never touches torch.distributed, so the single-process path costs nothing.
The shard helpers are pure functions of the sizes: every rank computes the same table
and picks its own row, so no rank has to tell another where its slice is.

Every collective and every send to the next stage is counted in this process
(`rank_message_counts`), for the executors' CountsMessages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from plugserve.datatypes import MessageCounts, RankLayout

logger = logging.getLogger(__name__)

# A gloo collective whose peer died blocks until this timeout; the executor notices the
# death much sooner through process sentinels, so this is only a backstop.
DEFAULT_TIMEOUT_S = 60.0

# What this process (one rank) has exchanged with the other ranks since it started.
_counts = MessageCounts()


def rank_message_counts() -> MessageCounts:
    """This rank's collectives and stage sends since it started (a copy)."""
    return _counts + MessageCounts()


def count_collective(tensor: torch.Tensor) -> None:
    """One collective call of this rank over `tensor`."""
    _counts.collectives += 1
    _counts.collective_bytes += tensor.numel() * tensor.element_size()


def _count_stage_send(tensor: torch.Tensor) -> None:
    _counts.stage_sends += 1
    _counts.stage_send_bytes += tensor.numel() * tensor.element_size()


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each of `parts` contiguous ranges covering range(total); the first
    `total % parts` ranges are one longer."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: query heads [q_start, q_end) and the KV heads
    [kv_start, kv_end) they read."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def shard_heads(num_heads: int, num_kv_heads: int, world_size: int) -> list[HeadShard]:
    """Split attention heads by KV-head groups, as evenly as possible.

    With at least as many KV heads as ranks, each rank gets a contiguous run of KV heads
    with all their query heads (9 query / 3 KV heads on 2 ranks: 6+2 and 3+1). With fewer
    KV heads than ranks, the ranks are spread over the KV heads and each KV head is
    replicated on its ranks, which split that head's query group between them; every
    rank then holds exactly one KV head, so its local heads stay a proper GQA layout.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        return [
            HeadShard(start * group, end * group, start, end)
            for start, end in split_evenly(num_kv_heads, world_size)
        ]
    shards = []
    for kv, (first, last) in enumerate(split_evenly(world_size, num_kv_heads)):
        ranks = last - first
        if group < ranks:
            raise ValueError(
                f"cannot shard {num_heads} query heads ({num_kv_heads} KV heads) over "
                f"{world_size} ranks: KV head {kv} has {group} query heads for {ranks} ranks"
            )
        for start, end in split_evenly(group, ranks):
            shards.append(HeadShard(kv * group + start, kv * group + end, kv, kv + 1))
    return shards


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the tensor-parallel group and the collectives the model
    and the model runner need. Rank 0 is the driver: it gathers logits and samples."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None: the default group

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def shard(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of a dimension split evenly (vocab, intermediate)."""
        return split_evenly(total, self.world_size)[self.rank]

    def head_shard(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        return shard_heads(num_heads, num_kv_heads, self.world_size)[self.rank]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.world_size > 1:
            count_collective(tensor)
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest `value` over ranks (every rank gets it)."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self._collective_device())
        count_collective(tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def gather_last_dim(self, tensor: torch.Tensor, total: int) -> torch.Tensor | None:
        """Concatenate each rank's evenly-split slice of the last dimension (see `shard`)
        on the driver; None on the other ranks."""
        if self.world_size == 1:
            return tensor
        ranges = split_evenly(total, self.world_size)
        widest = max(end - start for start, end in ranges)
        # Collectives need equal shapes: pad the shorter slices, trim after.
        pad = widest - tensor.shape[-1]
        if pad:
            tensor = torch.nn.functional.pad(tensor, (0, pad))
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in ranges] if self.is_driver else None
        count_collective(tensor)
        dist.gather(tensor, parts, dst=self._global_rank(0), group=self.group)
        if parts is None:
            return None
        return torch.cat(
            [p[..., : end - start] for p, (start, end) in zip(parts, ranges, strict=True)], -1
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """The driver's (or `src`'s) tensor on every rank, in place."""
        if self.world_size > 1:
            count_collective(tensor)
            dist.broadcast(tensor, src=self._global_rank(src), group=self.group)
        return tensor

    def _global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _collective_device(self) -> torch.device:
        return (
            torch.device("cuda") if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        )


NO_PARALLEL = ParallelContext()


def stage_layer_ranges(
    num_layers: int, num_stages: int, partition: list[int] | None = None
) -> list[tuple[int, int]]:
    """[start, end) of each pipeline stage's decoder layers: `partition`'s counts in
    order where given, else as even as possible with the first stages one longer (the
    last stage also runs the final norm and the head, so it is the one left shorter)."""
    if partition is None:
        if num_layers < num_stages:
            raise ValueError(
                f"cannot split {num_layers} layers into {num_stages} pipeline stages: "
                "every stage needs a layer"
            )
        return split_evenly(num_layers, num_stages)
    if len(partition) != num_stages or sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(
            f"pp_layer_partition {partition} must give {num_stages} stages at least one "
            f"layer each, {num_layers} layers in all"
        )
    ranges, start = [], 0
    for count in partition:
        ranges.append((start, start + count))
        start += count
    return ranges


@dataclass(frozen=True)
class PipelineStage:
    """Which consecutive decoder layers this process's model holds: [first_layer,
    end_layer) of stage `index` of `count`. Stage 0 embeds the tokens; the last stage
    runs the final norm and the head. The default is the whole model in one stage."""

    index: int = 0
    count: int = 1
    first_layer: int = 0
    end_layer: int | None = None  # None: through the last layer

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def holds_layer(self, layer_idx: int) -> bool:
        return self.first_layer <= layer_idx and (
            self.end_layer is None or layer_idx < self.end_layer
        )


WHOLE_MODEL = PipelineStage()


def init_parallel(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ParallelContext:
    """Join the default process group (gloo on CPU, nccl on CUDA) through the TCP
    rendezvous at master_addr:master_port, which global rank 0 hosts. On CUDA each
    process of a node takes the GPU of its local rank."""
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    host = f"[{master_addr}]" if ":" in master_addr else master_addr  # an IPv6 literal
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{host}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return ParallelContext(rank=rank, world_size=world_size)


@dataclass(frozen=True)
class StagePlacement:
    """What a model runner needs to run one pipeline stage."""

    index: int
    count: int
    partition: list[int] | None  # engine.pp_layer_partition
    previous_rank: int | None  # the global rank this stage receives from (None: first)
    next_rank: int | None  # the global rank it sends to (None: last)
    world: ParallelContext  # every rank of every stage: agreements such as the KV blocks

    def stage(self, num_layers: int) -> PipelineStage:
        """The layers this stage holds, logged: the split rule is stage_layer_ranges'."""
        first, end = stage_layer_ranges(num_layers, self.count, self.partition)[self.index]
        logger.info(
            "pipeline stage %d of %d: layers %d to %d", self.index, self.count, first, end - 1
        )
        return PipelineStage(self.index, self.count, first, end)


def join_groups(
    layout: RankLayout, partition: list[int] | None
) -> tuple[ParallelContext, StagePlacement | None]:
    """Once the default group spans every rank: this rank's tensor-parallel context
    (its stage's ranks) and, with several stages, its StagePlacement (else None). Every
    rank creates every stage's group, in order, as torch.distributed requires."""
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    if pp == 1:
        return ParallelContext(rank=layout.rank, world_size=tp), None
    groups = [dist.new_group(layout.stage_ranks(stage)) for stage in range(pp)]
    parallel = ParallelContext(rank=layout.tp_rank, world_size=tp, group=groups[layout.stage])
    placement = StagePlacement(
        index=layout.stage,
        count=pp,
        partition=partition,
        previous_rank=None if layout.stage == 0 else layout.rank - tp,
        next_rank=None if layout.stage == pp - 1 else layout.rank + tp,
        world=ParallelContext(rank=layout.rank, world_size=layout.world_size),
    )
    return parallel, placement


class PipelineLink:
    """A stage's activations to the next stage and from the previous one: hidden states
    and residual in one [2, tokens, hidden] message, then the stages' busy seconds so far
    (float64, one per stage: each stage fills in its own). Sends do not wait for the
    receiver, so a stage goes on to its next batch while the next stage still computes;
    a send completes before the following one starts, which keeps the order."""

    def __init__(
        self,
        placement: StagePlacement,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.previous_rank = placement.previous_rank
        self.next_rank = placement.next_rank
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.num_stages = placement.count
        self._sending: list[tuple[Any, torch.Tensor]] = []

    def send(self, hidden: torch.Tensor, residual: torch.Tensor, busy: list[float]) -> None:
        assert self.next_rank is not None
        self.wait_sent()
        message = torch.stack([hidden, residual])
        seconds = torch.tensor(busy, dtype=torch.float64, device=self.device)
        for tensor in (message, seconds):
            _count_stage_send(tensor)
            self._sending.append((dist.isend(tensor, dst=self.next_rank), tensor))

    def wait_sent(self) -> None:
        for work, _ in self._sending:
            work.wait()
        self._sending = []

    def receive(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """The previous stage's hidden states, residual and stage busy seconds."""
        assert self.previous_rank is not None
        message = torch.empty(
            (2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device
        )
        seconds = torch.empty(self.num_stages, dtype=torch.float64, device=self.device)
        dist.recv(message, src=self.previous_rank)
        dist.recv(seconds, src=self.previous_rank)
        return message[0], message[1], seconds.tolist()
