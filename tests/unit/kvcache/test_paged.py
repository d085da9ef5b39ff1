"""PagedKVAllocator: block tables, pool exhaustion, prefix cache, LRU eviction.

Every allocator a test builds through the `make_allocator` fixture is checked at teardown:
all blocks back in the pool, no references, no request tables, bookkeeping consistent.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest

from plugserve.datatypes import Request
from plugserve.interfaces.kv_cache import KVAllocator
from plugserve.sampling_params import SamplingParams
from plugserve_plugins.kvcache import paged
from plugserve_plugins.kvcache.paged import PagedKVAllocator, hash_block_tokens

BS = 4  # block size used throughout: small, so block boundaries are easy to cross

MakeAllocator = Callable[..., PagedKVAllocator]


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(), eos_token_id=None)


def assert_idle(alloc: PagedKVAllocator) -> None:
    alloc.check_consistency()
    assert alloc.num_free_blocks == alloc.num_blocks
    assert alloc.stats().num_free_blocks == alloc.num_blocks
    assert all(alloc.ref_count(b) == 0 for b in range(alloc.num_blocks))
    assert alloc.num_requests == 0


@pytest.fixture
def make_allocator() -> Iterator[MakeAllocator]:
    built: list[PagedKVAllocator] = []

    def build(
        num_blocks: int = 16, block_size: int = BS, prefix_caching: bool = True
    ) -> PagedKVAllocator:
        alloc = PagedKVAllocator(
            num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix_caching
        )
        built.append(alloc)
        return alloc

    yield build
    for alloc in built:
        assert_idle(alloc)


def admit(alloc: PagedKVAllocator, req: Request) -> list[int] | None:
    """First scheduling of a request, as the scheduler does it: look up, then allocate the
    whole remaining prompt in one go, and mark it computed."""
    hit_blocks, hit_tokens = alloc.get_computed_blocks(req)
    num_new = req.num_tokens - req.num_computed_tokens - hit_tokens
    new = alloc.allocate_slots(req, num_new, hit_blocks, hit_tokens)
    if new is not None:
        req.num_computed_tokens += hit_tokens + num_new
    return new


def decode(alloc: PagedKVAllocator, req: Request, token: int) -> list[int] | None:
    req.append_output_token_ids([token])
    new = alloc.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


# --------------------------------------------------------------------------- basics


def test_satisfies_protocol_and_is_registered() -> None:
    alloc = PagedKVAllocator(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    assert isinstance(alloc, KVAllocator)
    registered: dict[str, type] = {}
    paged.register_kv_allocators(register=lambda name, cls: registered.__setitem__(name, cls))
    assert registered == {"paged": PagedKVAllocator}


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0)])
def test_rejects_bad_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        PagedKVAllocator(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True)


def test_no_block_is_reserved(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator(num_blocks=3)
    req = make_request("a", list(range(3 * BS)))
    assert alloc.allocate_slots(req, 3 * BS) is not None
    assert sorted(alloc.block_ids("a")) == [0, 1, 2]
    assert alloc.num_free_blocks == 0
    assert alloc.stats().usage == 1.0
    alloc.free(req)


def test_prefill_then_decode_grows_table_at_block_boundaries(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator()
    req = make_request("a", list(range(6)))  # 1.5 blocks
    first = admit(alloc, req)
    assert first is not None and len(first) == 2
    assert alloc.block_ids("a") == first
    assert alloc.num_free_blocks == 14

    assert decode(alloc, req, 100) == []  # token 7 fits the second block
    assert decode(alloc, req, 101) == []  # token 8 fills it
    third = decode(alloc, req, 102)  # token 9 crosses into a third block
    assert third is not None and len(third) == 1
    assert alloc.block_ids("a") == first + third
    for t in range(103, 106):  # tokens 10..12 fill the third block
        assert decode(alloc, req, t) == []
    assert len(decode(alloc, req, 106) or []) == 1
    assert len(alloc.block_ids("a")) == 4
    assert alloc.num_free_blocks == 12
    alloc.free(req)


def test_chunked_prefill_allocates_per_chunk(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator()
    req = make_request("a", list(range(10)))
    for chunk, expected_blocks in [(3, 1), (3, 2), (3, 3), (1, 3)]:
        assert alloc.allocate_slots(req, chunk) is not None
        req.num_computed_tokens += chunk
        assert len(alloc.block_ids("a")) == expected_blocks
    alloc.free(req)


def test_exhausted_pool_returns_none_and_changes_nothing(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator(num_blocks=4)
    a = make_request("a", list(range(3 * BS)))
    assert admit(alloc, a) is not None
    b = make_request("b", list(range(1000, 1000 + 2 * BS)))
    before = alloc.stats()
    assert alloc.allocate_slots(b, 2 * BS) is None
    assert alloc.block_ids("b") == []
    assert alloc.num_requests == 1
    assert alloc.num_free_blocks == 1
    assert alloc.stats().num_cached_blocks == before.num_cached_blocks

    # A running request that cannot grow keeps its table untouched too.
    table_a = alloc.block_ids("a")
    assert alloc.allocate_slots(a, 2 * BS) is None
    assert alloc.block_ids("a") == table_a
    assert alloc.allocate_slots(a, BS) is not None  # exactly the last block
    assert alloc.num_free_blocks == 0
    alloc.check_consistency()
    alloc.free(a)
    alloc.free(b)  # never allocated: a no-op


def test_free_returns_every_block_and_is_idempotent(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator(num_blocks=8)
    reqs = [make_request(f"r{i}", list(range(i * 100, i * 100 + 5))) for i in range(3)]
    for r in reqs:
        assert admit(alloc, r) is not None
    assert alloc.num_free_blocks == 8 - 6
    for r in reqs:
        alloc.free(r)
        assert alloc.block_ids(r.request_id) == []
    alloc.free(reqs[0])
    assert_idle(alloc)


def test_zero_new_tokens_allocates_nothing(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator()
    req = make_request("a", list(range(5)))
    assert alloc.allocate_slots(req, 0) == []
    with pytest.raises(ValueError):
        alloc.allocate_slots(req, -1)
    alloc.free(req)


# --------------------------------------------------------------------------- prefix cache


def test_shared_prefix_hits_full_blocks_and_shares_them(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator()
    prompt = list(range(10))  # 2.5 blocks
    a = make_request("a", prompt)
    assert admit(alloc, a) == alloc.block_ids("a")  # a cold cache: every block is fresh
    table_a = alloc.block_ids("a")
    assert alloc.stats().num_cached_blocks == 2  # the half block is not cacheable
    assert alloc.stats().prefix_cache_hits == 0
    assert alloc.stats().hit_rate == 0.0

    b = make_request("b", [*prompt, 77, 78])
    hit_blocks, hit_tokens = alloc.get_computed_blocks(b)
    assert hit_blocks == table_a[:2]
    assert hit_tokens == 2 * BS
    stats = alloc.stats()
    assert stats.prefix_cache_queries == 10 + 12
    assert stats.prefix_cache_hits == 2 * BS
    assert stats.hit_rate == pytest.approx(8 / 22)

    # Lookups take no references.
    assert [alloc.ref_count(blk) for blk in hit_blocks] == [1, 1]
    new = alloc.allocate_slots(b, b.num_tokens - hit_tokens, hit_blocks, hit_tokens)
    assert new is not None and len(new) == 1  # only the tail block is fresh
    assert alloc.block_ids("b") == [*hit_blocks, *new]
    assert [alloc.ref_count(blk) for blk in hit_blocks] == [2, 2]
    assert alloc.ref_count(table_a[2]) == 1
    assert alloc.num_free_blocks == 16 - 4

    alloc.free(a)
    assert [alloc.ref_count(blk) for blk in hit_blocks] == [1, 1]
    assert alloc.num_free_blocks == 16 - 3
    alloc.free(b)


def test_fully_cached_prompt_leaves_a_token_to_compute(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator()
    prompt = list(range(2 * BS))  # exactly two full blocks
    a = make_request("a", prompt)
    assert admit(alloc, a) is not None
    assert alloc.stats().num_cached_blocks == 2

    b = make_request("b", prompt)
    hit_blocks, hit_tokens = alloc.get_computed_blocks(b)
    assert hit_blocks == alloc.block_ids("a")[:1]
    assert hit_tokens == BS
    assert b.num_tokens - hit_tokens >= 1
    assert admit(alloc, b) is not None  # recomputes the second block into a fresh one

    # Both requests now hold a block with the second block's hash; the first stays cached.
    assert alloc.block_ids("b")[1] != alloc.block_ids("a")[1]
    assert alloc.stats().num_cached_blocks == 2
    alloc.check_consistency()
    alloc.free(b)
    alloc.free(a)

    # A one-token prompt can never hit.
    c = make_request("c", [0])
    assert alloc.get_computed_blocks(c) == ([], 0)
    alloc.free(c)


def test_output_tokens_that_fill_a_block_become_cacheable(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator()
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    assert admit(alloc, a) is not None
    assert alloc.stats().num_cached_blocks == 1
    decode(alloc, a, 7)
    assert alloc.stats().num_cached_blocks == 1
    decode(alloc, a, 8)  # the second block is now full of computed tokens
    assert alloc.stats().num_cached_blocks == 2

    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit_blocks, hit_tokens = alloc.get_computed_blocks(b)
    assert hit_blocks == alloc.block_ids("a")[:2]
    assert hit_tokens == 2 * BS
    alloc.free(a)
    alloc.free(b)


def test_blocks_are_cached_only_once_computed_tokens_fill_them(
    make_allocator: MakeAllocator,
) -> None:
    alloc = make_allocator()
    a = make_request("a", list(range(12)))
    assert alloc.allocate_slots(a, 5) is not None  # a chunk covering 1.25 blocks
    a.num_computed_tokens = 5
    assert alloc.stats().num_cached_blocks == 1
    assert alloc.allocate_slots(a, 7) is not None
    a.num_computed_tokens = 12
    assert alloc.stats().num_cached_blocks == 3
    alloc.free(a)


def test_chained_hash_depends_on_the_prefix(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator()
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(alloc, a) is not None

    # A's second block, moved to the front: same content, different position.
    b = make_request("b", [5, 6, 7, 8, 9])
    assert alloc.get_computed_blocks(b) == ([], 0)
    # Same content at the same position, after a different first block.
    c = make_request("c", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert alloc.get_computed_blocks(c) == ([], 0)
    assert alloc.stats().prefix_cache_hits == 0

    root = hash_block_tokens(b"", [1, 2, 3, 4])
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(b"", [5, 6, 7, 8])
    assert hash_block_tokens(root, [5, 6, 7, 8]) == hash_block_tokens(root, [5, 6, 7, 8])
    for r in (a, b, c):
        alloc.free(r)


def _fill_and_free_two(alloc: PagedKVAllocator) -> tuple[list[int], list[int]]:
    """Run A then B (two full blocks each, distinct tokens) and free A, then B."""
    a = make_request("a", list(range(2 * BS)))
    b = make_request("b", list(range(100, 100 + 2 * BS)))
    assert admit(alloc, a) is not None
    assert admit(alloc, b) is not None
    table_a, table_b = alloc.block_ids("a"), alloc.block_ids("b")
    alloc.free(a)
    alloc.free(b)
    return table_a, table_b


def _probe(alloc: PagedKVAllocator, prompt: list[int]) -> int:
    """How many blocks of `prompt` are cached (one extra token so every full block counts)."""
    req = make_request("probe", [*prompt, -1])
    blocks, _ = alloc.get_computed_blocks(req)
    alloc.free(req)
    return len(blocks)


PROMPT_A = list(range(2 * BS))
PROMPT_B = list(range(100, 100 + 2 * BS))


def test_lru_eviction_reuses_least_recently_freed_tail_first(
    make_allocator: MakeAllocator,
) -> None:
    alloc = make_allocator(num_blocks=4)
    (a0, a1), (b0, b1) = _fill_and_free_two(alloc)
    assert alloc.stats().num_cached_blocks == 4

    # A was freed before B, each request tail first: the queue is a1, a0, b1, b0. Each
    # reuse evicts the block's hash, so the lookups shrink block by block.
    c = make_request("c", list(range(200, 200 + 4 * BS)))
    expected = [(a1, 1, 2), (a0, 0, 2), (b1, 0, 1), (b0, 0, 0)]
    for block, cached_a, cached_b in expected:
        assert alloc.allocate_slots(c, BS) == [block]
        c.num_computed_tokens += BS
        assert (_probe(alloc, PROMPT_A), _probe(alloc, PROMPT_B)) == (cached_a, cached_b)
    # C's own blocks are the cached ones now.
    assert alloc.stats().num_cached_blocks == 4
    assert alloc.allocate_slots(c, 1) is None
    alloc.free(c)


def test_hit_takes_a_free_block_out_of_the_middle_of_the_queue(
    make_allocator: MakeAllocator,
) -> None:
    alloc = make_allocator(num_blocks=5)
    (a0, a1), (b0, b1) = _fill_and_free_two(alloc)
    (never_used,) = set(range(5)) - {a0, a1, b0, b1}

    # Queue: never_used, a1, a0, b1, b0. D hits A's blocks from the middle and gets the
    # front block as its fresh one.
    d = make_request("d", [*PROMPT_A, 999])
    assert admit(alloc, d) is not None
    assert alloc.block_ids("d") == [a0, a1, never_used]

    # The next fresh blocks skip a1 and a0, which D holds now.
    c = make_request("c", list(range(200, 200 + 2 * BS)))
    assert alloc.allocate_slots(c, 2 * BS) == [b1, b0]
    assert (_probe(alloc, PROMPT_A), _probe(alloc, PROMPT_B)) == (2, 0)
    assert alloc.num_free_blocks == 0
    alloc.free(c)
    alloc.free(d)


def test_a_hit_on_free_blocks_counts_against_the_pool(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator(num_blocks=3)
    prompt = list(range(2 * BS))
    a = make_request("a", prompt)
    assert admit(alloc, a) is not None
    alloc.free(a)

    # Two free cached blocks are hit; a 4-block request then needs 2 fresh blocks, but
    # only 1 block is left once the hit ones are taken.
    b = make_request("b", [*prompt, *range(50, 50 + 2 * BS)])
    hit_blocks, hit_tokens = alloc.get_computed_blocks(b)
    assert hit_tokens == 2 * BS
    assert alloc.allocate_slots(b, 2 * BS, hit_blocks, hit_tokens) is None
    assert alloc.num_free_blocks == 3
    assert alloc.num_requests == 0
    assert alloc.stats().num_cached_blocks == 2

    # A 3-block request fits exactly.
    c = make_request("c", [*prompt, *range(60, 60 + BS)])
    hit_blocks, hit_tokens = alloc.get_computed_blocks(c)
    new = alloc.allocate_slots(c, BS, hit_blocks, hit_tokens)
    assert new is not None and len(new) == 1
    assert alloc.block_ids("c") == [*hit_blocks, *new]
    assert alloc.stats().num_cached_blocks == 3
    alloc.free(b)
    alloc.free(c)


def test_stale_or_misplaced_hits_are_rejected(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator(num_blocks=2)
    a = make_request("a", list(range(BS + 1)))
    assert admit(alloc, a) is not None
    alloc.free(a)

    b = make_request("b", list(range(BS + 1)))
    hit_blocks, hit_tokens = alloc.get_computed_blocks(b)
    assert hit_tokens == BS
    with pytest.raises(ValueError, match="cover"):
        alloc.allocate_slots(b, 1, hit_blocks, hit_tokens + 1)

    # Another request takes every block (evicting the cached one) before B allocates.
    c = make_request("c", list(range(100, 100 + 2 * BS)))
    assert alloc.allocate_slots(c, 2 * BS) is not None
    alloc.free(c)
    with pytest.raises(ValueError, match="no longer cached"):
        alloc.allocate_slots(b, 1, hit_blocks, hit_tokens)

    alloc.free(b)


def test_hit_blocks_only_on_first_allocation(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator()
    d = make_request("d", list(range(BS + 1)))
    assert admit(alloc, d) is not None
    e = make_request("e", [*range(BS + 1), 5, 6, 7, 8])
    assert alloc.allocate_slots(e, 1) is not None
    hit_blocks, hit_tokens = alloc.get_computed_blocks(e)
    assert hit_tokens == BS
    with pytest.raises(ValueError, match="first allocation"):
        alloc.allocate_slots(e, 1, hit_blocks, hit_tokens)
    alloc.check_consistency()
    alloc.free(d)
    alloc.free(e)


def test_prefix_caching_disabled_never_hits(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator(prefix_caching=False)
    prompt = list(range(3 * BS + 1))
    a = make_request("a", prompt)
    assert admit(alloc, a) is not None
    assert alloc.stats().num_cached_blocks == 0
    alloc.free(a)
    for i in range(2):
        r = make_request(f"r{i}", prompt)
        assert alloc.get_computed_blocks(r) == ([], 0)
        assert admit(alloc, r) is not None
        alloc.free(r)
    stats = alloc.stats()
    assert (stats.num_cached_blocks, stats.prefix_cache_hits, stats.hit_rate) == (0, 0, 0.0)


def test_reset_prefix_cache(make_allocator: MakeAllocator) -> None:
    alloc = make_allocator()
    prompt = list(range(2 * BS + 1))
    a = make_request("a", prompt)
    assert admit(alloc, a) is not None
    assert alloc.reset_prefix_cache() is False  # a still holds its blocks
    assert alloc.stats().num_cached_blocks == 2
    alloc.free(a)

    assert alloc.reset_prefix_cache() is True
    assert alloc.stats().num_cached_blocks == 0
    b = make_request("b", prompt)
    assert alloc.get_computed_blocks(b) == ([], 0)
    alloc.check_consistency()
    alloc.free(b)


# --------------------------------------------------------------------------- randomized


class _Simulation:
    """A tiny scheduler over one allocator, with a shadow of what each block holds.

    Writing each computed token into the shadow at its slot, and checking every running
    request reads its own tokens back through its block table, proves that prefix hits
    share only blocks with the right content and that no shared block is overwritten.
    """

    def __init__(self, alloc: PagedKVAllocator, rng: random.Random) -> None:
        self.alloc = alloc
        self.rng = rng
        self.bs = alloc.block_size
        self.shadow: list[list[int | None]] = [[None] * self.bs for _ in range(alloc.num_blocks)]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.prefixes = [[rng.randrange(8) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
        # Like max_model_len: a request stops growing, so the pool never has to hold one
        # request it cannot fit and the queue keeps moving.
        self.max_len = 24
        self.next_id = 0

    def arrive(self) -> None:
        prompt = list(self.rng.choice(self.prefixes))
        prompt += [self.rng.randrange(8) for _ in range(self.rng.randrange(0, 6))]
        self.waiting.append(make_request(f"r{self.next_id}", prompt))
        self.next_id += 1

    def write(self, req: Request, start: int, stop: int) -> None:
        table = self.alloc.block_ids(req.request_id)
        for pos in range(start, stop):
            block_id = table[pos // self.bs]
            assert self.alloc.ref_count(block_id) == 1, "a shared block would be overwritten"
            self.shadow[block_id][pos % self.bs] = req.all_token_ids[pos]

    def admit(self, req: Request) -> None:
        hit_blocks, hit_tokens = self.alloc.get_computed_blocks(req)
        assert hit_tokens < req.num_tokens
        remaining = req.num_tokens - hit_tokens
        chunk = self.rng.randint(1, remaining)
        free_before = self.alloc.num_free_blocks
        if self.alloc.allocate_slots(req, chunk, hit_blocks, hit_tokens) is None:
            assert self.alloc.num_free_blocks == free_before
            assert self.alloc.block_ids(req.request_id) == []
            return
        self.waiting.remove(req)
        self.running.append(req)
        req.num_computed_tokens = hit_tokens
        self.compute(req, chunk)

    def compute(self, req: Request, n: int) -> None:
        self.write(req, req.num_computed_tokens, req.num_computed_tokens + n)
        req.num_computed_tokens += n

    def step(self, req: Request) -> None:
        if req.num_computed_tokens == req.num_tokens:  # prefill done: decode one token
            if req.num_tokens >= self.max_len:
                self.finish(req)
                return
            req.append_output_token_ids([self.rng.randrange(8)])
            n = 1
        else:
            n = self.rng.randint(1, req.num_tokens - req.num_computed_tokens)
        table_before = self.alloc.block_ids(req.request_id)
        new = self.alloc.allocate_slots(req, n)
        if new is None:
            assert self.alloc.block_ids(req.request_id) == table_before
            self.preempt(req)
            return
        assert self.alloc.block_ids(req.request_id) == table_before + new
        self.compute(req, n)

    def preempt(self, req: Request) -> None:
        self.alloc.free(req)
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.insert(0, req)

    def finish(self, req: Request) -> None:
        self.alloc.free(req)
        self.running.remove(req)

    def check(self) -> None:
        self.alloc.check_consistency()
        held = sum(len(self.alloc.block_ids(r.request_id)) for r in self.running)
        assert self.alloc.num_free_blocks >= self.alloc.num_blocks - held
        for req in self.running:
            table = self.alloc.block_ids(req.request_id)
            assert len(table) * self.bs >= req.num_computed_tokens
            n = req.num_computed_tokens
            seen = [self.shadow[table[p // self.bs]][p % self.bs] for p in range(n)]
            assert seen == req.all_token_ids[:n], f"{req} reads another request's KV"

    def run(self, num_ops: int) -> None:
        for _ in range(num_ops):
            roll = self.rng.random()
            if roll < 0.2 or not (self.waiting or self.running):
                self.arrive()
            elif roll < 0.45 and self.waiting:
                self.admit(self.waiting[0])
            elif roll < 0.85 and self.running:
                self.step(self.rng.choice(self.running))
            elif roll < 0.95 and self.running:
                self.finish(self.rng.choice(self.running))
            elif self.running:
                self.preempt(self.rng.choice(self.running))
            self.check()
        for req in self.running + self.waiting:
            self.alloc.free(req)
        self.running.clear()
        self.waiting.clear()


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_randomized_sequences_keep_invariants(
    make_allocator: MakeAllocator, prefix_caching: bool, block_size: int
) -> None:
    # The same capacity in tokens (64) whatever the block size.
    alloc = make_allocator(
        num_blocks=64 // block_size, block_size=block_size, prefix_caching=prefix_caching
    )
    sim = _Simulation(alloc, random.Random(0))
    sim.run(3000)
    stats = alloc.stats()
    if prefix_caching:
        assert stats.prefix_cache_hits > 0
        assert alloc.reset_prefix_cache() is True
    else:
        assert stats.prefix_cache_hits == 0 == stats.num_cached_blocks
