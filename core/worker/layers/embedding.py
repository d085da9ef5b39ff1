"""The vocabulary embedding and the LM head, vocab-parallel, the head tied or not.

Each rank holds rows [start, end) of the vocabulary (an even split), for the embedding
and an untied head alike; `logits` gives this rank's slice of the fp32 logits, which the
model gathers (ParallelContext.gather_last_dim). A tied head multiplies by the
embedding's own matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.interfaces.model import LinearCompute, LinearMethod
from plugserve.worker.layers.linear import ColumnParallelLinear
from plugserve.worker.layers.weight_loader import copy_weight, set_weight_loader
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, end) of the vocabulary; ids outside the slice embed
    to zero and the all-reduce leaves every token the one rank's row that has it."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext = NO_PARALLEL):
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.start, self.end = parallel.shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size))
        set_weight_loader(self.weight, self.weight_loader)
        # As a tied LM head: what its linear method installed for the logits (a packed or
        # quantized copy of the matrix), called as (x, out_dtype).
        self.packed_head: LinearCompute | None = None
        # The linear method the model loader gave it as a tied head (None: F.linear over
        # the matrix).
        self.head_method: LinearMethod | None = None

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: None = None):
        copy_weight(param.data, tensor[self.start : self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return F.embedding(input_ids, self.weight)
        inside = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(inside, input_ids - self.start, 0)
        out = F.embedding(local, self.weight).masked_fill_(~inside[:, None], 0.0)
        return self.parallel.all_reduce(out)

    def install_head(self, compute: LinearCompute) -> None:
        """Compute the logits (as a tied head) by `compute`. The embedding keeps its own
        matrix: the lookup reads rows of it."""
        self.packed_head = compute

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """As a tied LM head: hidden [N, hidden] → this rank's fp32 logits [N, end - start]."""
        if self.packed_head is not None:
            return _packed_logits(self.packed_head, hidden_states)
        return F.linear(hidden_states, self.weight).float()


class ParallelLMHead(ColumnParallelLinear):
    """An untied LM head: the same vocabulary rows as the embedding's on this rank."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext = NO_PARALLEL):
        super().__init__(hidden_size, vocab_size, False, parallel)

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → this rank's fp32 logits [N, out_end - out_start]."""
        if self.packed is not None:
            return _packed_logits(self.packed, hidden_states)
        return self(hidden_states).float()  # .float() is a no-op in fp32


def _packed_logits(head: LinearCompute, hidden_states: torch.Tensor) -> torch.Tensor:
    # An installed head gives fp32 logits itself (the own bf16 kernel unrounded):
    # converting them after was the one OpenMP region left in a batch-1 step, its
    # thread asleep.
    return head(hidden_states, torch.float32)
