"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k
experts, and the token's output is their gated MLPs' outputs weighted by the router.

- Router: a replicated Linear hidden → num_experts; softmax over all experts in fp32,
  top-k, renormalized over the k where the family says so (Hugging Face's order).
- Experts: every expert's gate and up projections stacked in `w13` [E, 2 * I, H] (gate
  rows first, as one matmul) and its down projection in `w2` [E, H, I]. A step groups
  its tokens by expert and runs only the experts that got tokens, each on its tokens'
  rows, adding the weighted outputs into place (index_add): what runs is proportional
  to the k experts a token uses, not to E, and it runs on ATen everywhere.
- Tensor parallelism: every expert's intermediate dimension is split over ranks (each
  rank holds its slice of every expert's gate, up and down), the router is replicated,
  and the partial sums of all experts are summed over ranks by one all-reduce.

Checkpoints name every expert's projections apart (`experts.{e}.gate_proj.weight`, or
Mixtral's `experts.{e}.w1.weight`); `ExpertCheckpointNames` routes each into its slice
of the stacked weights, by shard id (e, 0) gate, (e, 1) up, e down, so a checkpoint
missing one expert's projection is reported like any missing weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.worker.layers.direct_call import direct_call
from plugserve.worker.layers.linear import Linear
from plugserve.worker.layers.weight_loader import copy_weight, set_weight_loader
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext

GATE, UP = 0, 1  # a w13 shard id is (expert, GATE or UP); a w2 shard id is the expert


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] → (fp32 weights [T, k], expert ids [T, k]): softmax over all
    experts in fp32, the k largest, divided by their sum where `renormalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@direct_call
class FusedMoE(nn.Module):
    """x [T, hidden] → [T, hidden]: sum over each token's top-k experts of
    weight * down(silu(gate(x)) * up(x)), summed over tensor-parallel ranks."""

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        weigh_in_fp32: bool,
        hidden_act: str = "silu",
        parallel: ParallelContext = NO_PARALLEL,
    ) -> None:
        """intermediate_size: one expert's (all ranks'). renormalize: divide the top-k
        weights by their sum. weigh_in_fp32: multiply an expert's output by its fp32
        weight and round the product (Mixtral), rather than round the weight to the
        activations' dtype first (Qwen3-MoE); the two differ only below fp32."""
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r} for experts (supported: silu)")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"cannot route each token to {top_k} of {num_experts} experts")
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.weigh_in_fp32 = renormalize, weigh_in_fp32
        self.parallel = parallel
        self.inter_start, self.inter_end = parallel.shard(intermediate_size)
        inter = self.inter_end - self.inter_start
        self.gate = Linear(hidden_size, num_experts, bias=False)  # the router, replicated
        # Every parameter is overwritten by the checkpoint: torch.empty skips initialization.
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        set_weight_loader(
            self.w13,
            self.load_w13,
            [(e, part) for e in range(num_experts) for part in (GATE, UP)],
        )
        set_weight_loader(self.w2, self.load_w2, range(num_experts))

    def load_w13(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any) -> None:
        """An expert's gate or up projection [I, H]: this rank's rows of it."""
        expert, part = shard_id
        inter = self.inter_end - self.inter_start
        dest = param.data[expert, part * inter : (part + 1) * inter]
        copy_weight(dest, tensor[self.inter_start : self.inter_end])

    def load_w2(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any) -> None:
        """An expert's down projection [H, I]: this rank's columns of it."""
        copy_weight(param.data[shard_id], tensor[:, self.inter_start : self.inter_end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = torch.zeros_like(x)
        # The (token, slot) pairs sorted by expert, each expert's run in token order.
        order = experts.flatten().argsort(stable=True)
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order, None]
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows, weight = tokens[start : start + count], pair_weights[start : start + count]
            start += count
            gate, up = F.linear(x[rows], self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert])
            y = (y * weight).to(y.dtype) if self.weigh_in_fp32 else y * weight.to(y.dtype)
            out.index_add_(0, rows, y)
        return self.parallel.all_reduce(out)


@dataclass(frozen=True)
class ExpertCheckpointNames:
    """How a family's checkpoints name a MoE block's tensors, and where each goes in
    FusedMoE (which a decoder layer holds as `mlp`).

    blocks: the block's checkpoint names (Mixtral's transformers-4 checkpoints say
    `block_sparse_moe`, transformers 5's modules `mlp`); gate, up, down: an expert's
    projections (`experts.{e}.{gate}.weight`). The router is `{block}.gate.weight`.
    """

    blocks: tuple[str, ...]
    gate: str
    up: str
    down: str

    def route(self, name: str) -> tuple[str, Any] | None:
        """A checkpoint name → (FusedMoE parameter name, shard id), or None where the name
        is not a MoE block's (checkpoint.load_checkpoint's `route`)."""
        match = self._pattern.fullmatch(name)
        if match is None:
            return None
        layer, expert, projection = match.group("layer", "expert", "projection")
        if expert is None:  # the router
            return f"{layer}.mlp.gate.weight", None
        e = int(expert)
        if projection == self.down:
            return f"{layer}.mlp.w2", e
        return f"{layer}.mlp.w13", (e, GATE if projection == self.gate else UP)

    def unstack(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights` with transformers 5's stacked expert tensors (what its modules hold:
        `experts.gate_up_proj` [E, 2 * I, H], gate rows first, and `experts.down_proj`
        [E, H, I]) given as each expert's own, under this family's names."""
        stacked = re.compile(
            rf"(?P<block>.+\.(?:{'|'.join(map(re.escape, self.blocks))}))\.experts\."
            r"(?P<which>gate_up_proj|down_proj)"
        )
        for name, tensor in weights:
            match = stacked.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            block = match.group("block")
            for e, expert in enumerate(tensor):
                if match.group("which") == "down_proj":
                    yield f"{block}.experts.{e}.{self.down}.weight", expert
                else:
                    gate, up = expert.chunk(2, dim=0)
                    yield f"{block}.experts.{e}.{self.gate}.weight", gate
                    yield f"{block}.experts.{e}.{self.up}.weight", up

    @cached_property
    def _pattern(self) -> re.Pattern[str]:
        blocks = "|".join(map(re.escape, self.blocks))
        projections = "|".join(map(re.escape, (self.gate, self.up, self.down)))
        return re.compile(
            rf"(?P<layer>.+)\.(?:{blocks})\."
            rf"(?:experts\.(?P<expert>\d+)\.(?P<projection>{projections})\.weight|gate\.weight)"
        )


QWEN_MOE_NAMES = ExpertCheckpointNames(("mlp",), "gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = ExpertCheckpointNames(("block_sparse_moe", "mlp"), "w1", "w3", "w2")
