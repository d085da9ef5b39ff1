"""The pooler slot: a pooling request's prompt hidden states → its one output."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

# Which of a prompt's final hidden states a pooler reads: the first token's, the last
# token's, or every token's in order. The model runner keeps only those across the
# chunks of a chunked prefill, and a pooler that reads every token keeps its requests
# out of the prefix cache (a cached prefix computes no hidden states).
PoolerTokens = Literal["first", "last", "all"]


@runtime_checkable
class Pooler(Protocol):
    """Built once per model load with no arguments (or `options=`), selected by
    `stack.pooler`. The core does the rest of the pooled output: the classification head
    and its activation, Matryoshka truncation to `dimensions`, L2 normalisation."""

    tokens: ClassVar[PoolerTokens]

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size]: the rows `tokens` names of one request (one row for
        first or last, every prompt token's for all), in the model's dtype → its pooled
        output, [hidden_size] (or [n, hidden_size] for a pooler that keeps every
        token)."""
        ...
