"""The KV-cache block allocator the scheduler asks for blocks (with prefix caching)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from plugserve.datatypes import Request


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int  # free, including cached blocks that no request holds
    num_cached_blocks: int  # blocks findable by hash
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found in the cache

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@runtime_checkable
class KVAllocator(Protocol):
    """Owns which KV-cache blocks hold which request's tokens (phase 6)."""

    block_size: int
    num_blocks: int

    def __init__(
        self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool
    ) -> None: ...

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest prefix of the request's tokens already cached, in full blocks:
        (block ids, number of tokens). Never the whole request: at least one token is left
        to compute, so the model produces logits. Takes no references; updates hit stats."""
        ...

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Room for `num_new_tokens` tokens after the request's computed ones (plus the
        prefix-cache hit passed in, on its first allocation). Returns the block ids appended
        to the request's table, or None, changing nothing, if the pool cannot give them.
        Full blocks among the tokens being computed become findable by their hash."""
        ...

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        ...

    def free(self, request: Request) -> None:
        """Release the request's blocks (cached ones stay findable until evicted)."""
        ...

    @property
    def num_free_blocks(self) -> int: ...

    def stats(self) -> KVCacheStats: ...

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False if blocks are still held by requests."""
        ...
