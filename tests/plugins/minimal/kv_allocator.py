"""A third-party KV allocator, the smallest real one: a free list of blocks and a table
per request, with no prefix cache, so no block is ever shared.

Loaded through PLUGSERVE_PLUGIN_MODULES=tests.plugins.minimal.kv_allocator;
tests/plugins/test_minimal_plugins.py selects it.
"""

from __future__ import annotations

from collections.abc import Sequence

from plugserve import hookimpl
from plugserve.datatypes import Request
from plugserve.hookspecs import Register
from plugserve.interfaces.kv_cache import KVCacheStats


class FreeListAllocator:
    """interfaces.kv_cache.KVAllocator without prefix caching."""

    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if enable_prefix_caching:
            raise ValueError("kv_allocator 'free_list' keeps no prefix cache: turn it off")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        return [], 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        if new_computed_blocks or num_new_computed_tokens:
            raise ValueError("kv_allocator 'free_list' never reports computed blocks")
        table = self._tables.get(request.request_id, [])
        num_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = max(0, -(-num_tokens // self.block_size) - len(table))
        if num_needed > len(self._free):
            return None
        new_blocks = [self._free.pop() for _ in range(num_needed)]
        self._tables[request.request_id] = table + new_blocks
        return new_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def free(self, request: Request) -> None:
        self._free += reversed(self._tables.pop(request.request_id, []))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=len(self._free),
            num_cached_blocks=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
        )

    def reset_prefix_cache(self) -> bool:
        return len(self._free) == self.num_blocks


@hookimpl
def register_kv_allocators(register: Register) -> None:
    register("free_list", FreeListAllocator)
