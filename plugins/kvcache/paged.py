"""`paged`: the bundled KV allocator — a block pool, per-request block tables and a
prefix cache keyed by chained block hashes.

Every one of the `num_blocks` blocks is usable: no block is reserved as a null or
padding block, so `num_free_blocks` starts at `num_blocks` and `stats().num_blocks` is
`num_blocks`. Padding in the worker's block tables is harmless because attention never
reads past a request's `seq_lens`.

Blocks with no reference wait in a free queue ordered least recently freed first.
Allocation takes from the front; a block taken there that still carries a hash drops
out of the prefix cache at that moment (lazy eviction), so a freed block stays findable
until the pool actually needs it. A request frees its blocks tail first, which keeps the
shared prefix blocks (the ones most likely to be hit again) out of eviction longest.

A block's hash chains the hash of the block before it with the block's own tokens, so
equal content at a different position, or after a different prefix, never matches.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from plugserve import hookimpl
from plugserve.interfaces.kv_cache import KVCacheStats

if TYPE_CHECKING:
    from plugserve.datatypes import Request
    from plugserve.hookspecs import Register

BlockHash = bytes

# The parent of a request's first block. Any fixed value works; empty keeps it short.
_ROOT_HASH: BlockHash = b""


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one full block.

    sha256 rather than Python's `hash`: a collision would silently serve another
    prompt's KV, and 64-bit tuple hashes of attacker-chosen token ids can be made to
    collide. Token ids are packed as int64 so that no id range aliases another.
    """
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class PagedKVAllocator:
    """Block pool with reference counts, LRU reuse of free blocks and a prefix cache.

    Single-threaded by design: the engine's busy loop is its only caller.
    """

    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

        # Per-block state in flat lists indexed by block id: cheaper than one object per
        # block, and the pool is touched on every step.
        self._ref_cnt: list[int] = [0] * num_blocks
        # Set only while the block is the one `_cached` maps its hash to, so that
        # `_block_hash[b] is not None` ⇔ `_cached[_block_hash[b]] == b`.
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        # An OrderedDict is a doubly linked list with O(1) removal by key: a cached block
        # that a new request hits leaves the queue from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

        self._tables: dict[str, list[int]] = {}
        # Chained hashes of the request's full blocks, extended lazily as tokens arrive.
        # Kept apart from the table because a waiting request is looked up (and hashed)
        # before it holds any block.
        self._req_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of the request's table are already registered (or
        # were tried), so each step hashes only the blocks it newly filled.
        self._num_registered: dict[str, int] = {}

        self._queries = 0
        self._hits = 0

    # ----------------------------------------------------------------- KVAllocator

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        if not self.enable_prefix_caching:
            return [], 0
        # At least one token must be computed so the model yields logits to sample from.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for i in range(max_blocks):
            block_id = self._cached.get(self._request_hash(request, i))
            if block_id is None:
                break
            hit.append(block_id)
        num_hit_tokens = len(hit) * self.block_size
        self._queries += request.num_tokens
        self._hits += num_hit_tokens
        return hit, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        req_id = request.request_id
        table = self._tables.get(req_id)
        if new_computed_blocks or num_new_computed_tokens:
            self._check_computed_blocks(
                request, table, new_computed_blocks, num_new_computed_tokens
            )

        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_held = (len(table) if table else 0) + len(new_computed_blocks)
        num_needed = max(0, -(-num_tokens // self.block_size) - num_held)
        # A hit block nobody holds sits in the free queue; taking it shrinks what is left
        # for fresh blocks.
        num_hit_free = sum(1 for b in new_computed_blocks if self._ref_cnt[b] == 0)
        if num_needed > len(self._free) - num_hit_free:
            return None

        if table is None:
            table = self._tables[req_id] = []
            self._num_registered[req_id] = 0
        # Touch the hit blocks before popping fresh ones, so the pops cannot evict them.
        for block_id in new_computed_blocks:
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
            self._ref_cnt[block_id] += 1
        if new_computed_blocks:
            table.extend(new_computed_blocks)
            # Hit blocks are cached already; registration resumes after them.
            self._num_registered[req_id] = len(new_computed_blocks)

        new_blocks = [self._pop_free() for _ in range(num_needed)]
        table.extend(new_blocks)

        if self.enable_prefix_caching:
            self._register_full_blocks(request, table, min(num_tokens, request.num_tokens))
        return new_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def free(self, request: Request) -> None:
        req_id = request.request_id
        # Also drops the hashes of a request that was only looked up, never allocated.
        self._req_hashes.pop(req_id, None)
        self._num_registered.pop(req_id, None)
        table = self._tables.pop(req_id, None)
        if table is None:
            return
        for block_id in reversed(table):
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                self._free[block_id] = None

    def free_blocks_past(self, request: Request, num_tokens: int) -> int:
        """capabilities.FreesBlocksPastTokens. The blocks released hold no token the
        request keeps, hence no hash: they go to the front of the free queue, to be taken
        again before any block the prefix cache can still hit."""
        req_id = request.request_id
        table = self._tables.get(req_id)
        keep = -(-num_tokens // self.block_size)
        if not table or len(table) <= keep:
            return 0
        released = table[keep:]
        del table[keep:]
        for block_id in released:
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
        self._num_registered[req_id] = min(self._num_registered.get(req_id, 0), keep)
        return len(released)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=len(self._free),
            num_cached_blocks=len(self._cached),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. The query/hit counters are cumulative metrics and
        are kept; the requests' own token hashes stay valid and are kept too."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        return True

    # ----------------------------------------------------------------- introspection

    def ref_count(self, block_id: int) -> int:
        """How many requests hold the block."""
        return self._ref_cnt[block_id]

    @property
    def num_requests(self) -> int:
        """Requests that currently hold a block table."""
        return len(self._tables)

    def check_consistency(self) -> None:
        """Raise AssertionError if the pool's bookkeeping disagrees with itself.

        O(num_blocks + blocks held): for tests and debugging, not the hot path.
        """
        held = [0] * self.num_blocks
        for req_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {req_id!r} holds a block twice: {table}")
            for block_id in table:
                held[block_id] += 1
        if held != self._ref_cnt:
            raise AssertionError("reference counts differ from the block tables")
        idle = [b for b in range(self.num_blocks) if self._ref_cnt[b] == 0]
        if sorted(self._free) != idle:
            raise AssertionError("the free queue is not exactly the unreferenced blocks")
        for block_hash, block_id in self._cached.items():
            if self._block_hash[block_id] != block_hash:
                raise AssertionError(f"cached hash maps to block {block_id}, which lost it")
        num_hashed = sum(h is not None for h in self._block_hash)
        if num_hashed != len(self._cached):
            raise AssertionError("a block carries a hash the cache does not map to it")

    # ----------------------------------------------------------------- internals

    def _check_computed_blocks(
        self,
        request: Request,
        table: list[int] | None,
        new_computed_blocks: Sequence[int],
        num_new_computed_tokens: int,
    ) -> None:
        """Reject a prefix hit the caller cannot legitimately pass: these are caller bugs
        that would otherwise corrupt another request's KV."""
        if table:
            raise ValueError(
                f"request {request.request_id!r}: prefix-cache blocks can only be passed "
                "on its first allocation"
            )
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(
                f"{len(new_computed_blocks)} computed blocks cover "
                f"{len(new_computed_blocks) * self.block_size} tokens, "
                f"not {num_new_computed_tokens}"
            )
        for i, block_id in enumerate(new_computed_blocks):
            # A block evicted and reused since get_computed_blocks no longer holds these
            # tokens; sharing it would feed the request someone else's KV.
            if self._block_hash[block_id] != self._request_hash(request, i):
                raise ValueError(
                    f"request {request.request_id!r}: block {block_id} is no longer cached "
                    "for its prefix; call get_computed_blocks again"
                )

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._block_hash[block_id] = None
        self._ref_cnt[block_id] = 1
        return block_id

    def _register_full_blocks(self, request: Request, table: list[int], num_tokens: int) -> None:
        req_id = request.request_id
        start = self._num_registered[req_id]
        end = num_tokens // self.block_size
        for i in range(start, end):
            block_hash = self._request_hash(request, i)
            block_id = table[i]
            # Another request may have filled a block with the same tokens first (both
            # prefilled before either was cached). The first one stays the cached copy;
            # this one is returned to the pool as a plain block once freed.
            if block_hash not in self._cached:
                self._cached[block_hash] = block_id
                self._block_hash[block_id] = block_hash
        self._num_registered[req_id] = max(start, end)

    def _request_hash(self, request: Request, index: int) -> BlockHash:
        """Hash of the request's full block `index`, computing any missing ones before it."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        size = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block_tokens(parent, tokens[i * size : (i + 1) * size]))
        return hashes[index]


@hookimpl
def register_kv_allocators(register: Register) -> None:
    register("paged", PagedKVAllocator)
