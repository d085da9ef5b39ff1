"""TorchPagedAttention against dense per-request causal attention.

Two steps over a paged cache with scattered blocks: the first prefills some requests,
the second mixes every row kind the backend distinguishes (a decode, a one-token prompt,
a fresh prefill, a prefill chunk after cached context), in no particular order. Each
layer's options (interfaces.model.LayerAttention: sliding window, logit soft-capping, softmax
scale) are held to the same dense reference with the option applied, on both paths.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from plugserve import ops
from plugserve.capabilities import honours_layer_attention
from plugserve.interfaces.model import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionBatch,
    AttentionSpec,
    LayerAttention,
)
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention, register_attention_backends
from tests.kernel_support import missing_cpu_flags

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 2, 16, 4, 48
SPEC = AttentionSpec(
    num_layers=LAYERS,
    num_heads=HEADS,
    num_kv_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    block_size=BLOCK_SIZE,
    dtype=torch.float32,
    device=torch.device("cpu"),
)


@dataclass
class Sequence:
    """One request's q/k/v for every position and layer, and its (scattered) blocks."""

    q: torch.Tensor  # [layers, seq, heads, dim]
    k: torch.Tensor  # [layers, seq, kv_heads, dim]
    v: torch.Tensor
    blocks: list[int]

    def slots(self, start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        return (
            np.asarray(self.blocks)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        )


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerAttention = FULL_ATTENTION
) -> torch.Tensor:
    """Dense causal attention over one whole sequence: [S, H, D] with GQA expanded, as
    transformers' eager attention computes it: scores scaled, soft-capped, masked
    (causal, and within the window: key j seen from query i when i - window < j <= i)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = layer.scale if layer.scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if layer.logit_softcap is not None:
        scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
    i = torch.arange(q.shape[0])[:, None]
    j = torch.arange(q.shape[0])[None, :]
    seen = j <= i
    if layer.sliding_window is not None:
        seen &= j > i - layer.sliding_window
    probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_sequences(lengths: dict[str, int]) -> dict[str, Sequence]:
    generator = torch.Generator().manual_seed(0)
    pool = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    sequences = {}
    for name, length in lengths.items():
        num_blocks = -(-length // BLOCK_SIZE)
        blocks, pool = pool[:num_blocks], pool[num_blocks:]

        def rand(heads: int, length: int = length) -> torch.Tensor:
            return torch.randn(LAYERS, length, heads, HEAD_DIM, generator=generator)

        sequences[name] = Sequence(rand(HEADS), rand(KV_HEADS), rand(KV_HEADS), blocks)
    return sequences


def run_step(
    backend: TorchPagedAttention, sequences: dict[str, Sequence], rows: list[tuple[str, int, int]]
) -> None:
    """Run rows (name, start, end) as one batch; check outputs and the cache per layer."""
    max_blocks = max(len(s.blocks) for s in sequences.values())
    block_table = np.zeros((len(rows), max_blocks), dtype=np.int32)
    for i, (name, _, _) in enumerate(rows):
        block_table[i, : len(sequences[name].blocks)] = sequences[name].blocks
    batch = AttentionBatch(
        query_start_loc=np.cumsum([0] + [end - start for _, start, end in rows], dtype=np.int32),
        seq_lens=np.array([end for _, _, end in rows], dtype=np.int32),
        block_table=block_table,
        slot_mapping=np.concatenate([sequences[n].slots(s, e) for n, s, e in rows]),
    )
    backend.prepare(batch)
    for layer in range(LAYERS):
        q, k, v = (
            torch.cat([getattr(sequences[n], part)[layer, s:e] for n, s, e in rows])
            for part in ("q", "k", "v")
        )
        out = backend.forward(layer, q, k, v)
        assert out.shape == q.shape

        offset = 0
        for name, start, end in rows:
            seq = sequences[name]
            expected = reference_attention(
                seq.q[layer, :end],
                seq.k[layer, :end],
                seq.v[layer, :end],
                backend.spec.layer(layer),
            )
            torch.testing.assert_close(
                out[offset : offset + end - start], expected[start:end], atol=1e-5, rtol=1e-5
            )
            offset += end - start

        assert backend.kv_cache is not None
        cache = backend.kv_cache[layer].view(2, -1, KV_HEADS, HEAD_DIM)
        slots = torch.from_numpy(batch.slot_mapping)
        assert torch.equal(cache[0, slots], k)
        assert torch.equal(cache[1, slots], v)


@pytest.fixture(params=["native", "sdpa"])
def backend(request: pytest.FixtureRequest) -> TorchPagedAttention:
    """Both paths: the C++ kernel (every token a query row over the paged cache), and
    SDPA (decodes gather their blocks; prefills attend per row)."""
    options = TorchPagedAttention.Options(kernel=request.param)
    backend = TorchPagedAttention(spec=SPEC, options=options)
    backend.allocate_kv_cache(NUM_BLOCKS)
    return backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows",
    [
        [(0, 1)],  # (cached context, new tokens) per request: one decode
        [(299, 1)],  # one row over a long context: its KV heads shared by the threads
        [(5, 1), (40, 1), (299, 1)],  # few rows: the kernel splits work by KV head
        [(n, 1) for n in range(0, 400, 10)],  # many rows: by row
        [(0, 37), (50, 20), (17, 1), (0, 1), (130, 129)],  # prefills, chunks and decodes
    ],
    ids=["one-decode", "one-long-decode", "few-decodes", "many-decodes", "mixed"],
)
# The kernel is compiled for block sizes 16 and 32, and reads any other at run time.
@pytest.mark.parametrize("block_size", [16, 32, 5])
# Plain, and with every option: the window (40) cuts the long rows' context mid-block.
@pytest.mark.parametrize(
    "layer",
    [FULL_ATTENTION, LayerAttention(sliding_window=40, logit_softcap=3.0, scale=0.2)],
    ids=["full", "window-softcap-scale"],
)
def test_native_kernel_matches_sdpa_at_model_shapes(
    dtype: torch.dtype, rows: list[tuple[int, int]], block_size: int, layer: LayerAttention
) -> None:
    # SmolLM2's heads: 9 query, 3 KV, dim 64, the shapes the kernel's fast paths serve.
    spec = AttentionSpec(
        num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64, block_size=block_size,
        dtype=dtype, device=torch.device("cpu"), layers=(layer,),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(len(rows))
    seq_lens = np.array([c + n for c, n in rows])
    query_lens = np.array([n for _, n in rows])
    num_blocks = int(sum(-(-seq_lens // block_size))) + 1
    block_table = np.zeros((len(rows), int(-(-seq_lens.max() // block_size))), dtype=np.int32)
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    for row, length in enumerate(seq_lens):
        used = -(-length // block_size)
        block_table[row, :used], pool = pool[:used], pool[used:]
    positions = [np.arange(c, c + n) for c, n in rows]
    batch = AttentionBatch(
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_table=block_table,
        slot_mapping=np.concatenate(
            [
                block_table[r, p // block_size] * block_size + p % block_size
                for r, p in enumerate(positions)
            ]
        ),
    )
    tokens = int(query_lens.sum())
    cache = torch.randn(1, 2, num_blocks, block_size, 3, 64, generator=generator).to(dtype)
    q, k, v = (torch.randn(tokens, h, 64, generator=generator).to(dtype) for h in (9, 3, 3))
    outputs = []
    for kernel in ("native", "sdpa"):
        backend = TorchPagedAttention(spec=spec, options=TorchPagedAttention.Options(kernel=kernel))
        backend.allocate_kv_cache(num_blocks)
        assert backend.kv_cache is not None
        backend.kv_cache.copy_(cache)
        backend.prepare(batch)
        outputs.append(backend.forward(0, q, k, v).float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outputs[0], outputs[1], atol=tolerance, rtol=tolerance)


def test_mixed_batch_matches_dense_attention(backend: TorchPagedAttention) -> None:
    run_mixed_steps(backend)


def run_mixed_steps(backend: TorchPagedAttention) -> None:
    sequences = make_sequences({"a": 8, "b": 5, "c": 13, "d": 1, "e": 9})
    # Step 1: fresh prefills that leave context behind in the cache.
    run_step(backend, sequences, [("a", 0, 7), ("c", 0, 6), ("e", 0, 8)])
    # Step 2: a chunk after 6 cached tokens (crossing blocks), a decode mid-block, a fresh
    # prefill, a one-token prompt, a decode opening a new block.
    run_step(backend, sequences, [("c", 6, 13), ("a", 7, 8), ("b", 0, 5), ("d", 0, 1), ("e", 8, 9)])


# Options that bite at these sizes: a window of 3 tokens slides within every row longer
# than 3 (and across the cache's 4-token blocks); the random scores spread ~1 at the
# default scale, so a cap of 1.0 flattens them; a scale of 0.5 doubles them.
LAYER_OPTIONS = {
    "window": LayerAttention(sliding_window=3),
    "softcap": LayerAttention(logit_softcap=1.0),
    "scale": LayerAttention(scale=0.5),
    "all": LayerAttention(sliding_window=5, logit_softcap=1.5, scale=0.4),
}


@pytest.mark.parametrize("kernel", ["native", "sdpa"])
@pytest.mark.parametrize("option", list(LAYER_OPTIONS))
def test_each_layer_attends_as_its_options_say(kernel: str, option: str) -> None:
    """Layer 0 with the option, layer 1 plain: fresh prefills, a chunk after cached
    context, decodes and one-token prompts, each against the dense reference with the
    option applied (the reference is the option's definition)."""
    spec = AttentionSpec(**{**SPEC.__dict__, "layers": (LAYER_OPTIONS[option], FULL_ATTENTION)})
    backend = TorchPagedAttention(spec=spec, options=TorchPagedAttention.Options(kernel=kernel))
    backend.allocate_kv_cache(NUM_BLOCKS)
    run_mixed_steps(backend)


def test_options_change_the_output() -> None:
    """The reference really applies each option (else the tests above prove nothing)."""
    seq = make_sequences({"a": 13})["a"]
    plain = reference_attention(seq.q[0], seq.k[0], seq.v[0])
    for layer in LAYER_OPTIONS.values():
        changed = reference_attention(seq.q[0], seq.k[0], seq.v[0], layer)
        assert (changed - plain).abs().max() > 0.05, layer


def test_the_window_includes_the_query_itself() -> None:
    """A window of 1 attends to the query's own position only: the output is its v."""
    seq = make_sequences({"a": 9})["a"]
    out = reference_attention(seq.q[0], seq.k[0], seq.v[0], LayerAttention(sliding_window=1))
    torch.testing.assert_close(out, seq.v[0].repeat_interleave(HEADS // KV_HEADS, dim=1))
    backend = TorchPagedAttention(
        spec=AttentionSpec(**{**SPEC.__dict__, "layers": (LayerAttention(sliding_window=1),) * 2})
    )
    backend.allocate_kv_cache(NUM_BLOCKS)
    run_step(backend, {"a": seq}, [("a", 0, 9)])


def test_declares_every_layer_option_it_honours() -> None:
    assert honours_layer_attention(TorchPagedAttention)
    assert TorchPagedAttention.layer_attention_options == {
        "sliding_window",
        "logit_softcap",
        "scale",
        "bidirectional",
    }


def test_a_layer_option_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        LayerAttention(sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap must be positive"):
        LayerAttention(logit_softcap=0.0)
    with pytest.raises(ValueError, match="has 1 entries for 2 layers"):
        AttentionSpec(**{**SPEC.__dict__, "layers": (FULL_ATTENTION,)})


def test_rows_see_blocks_another_row_fills_in_the_same_step(
    backend: TorchPagedAttention,
) -> None:
    # A prefix-cache hit may land on a block whose tokens another request computes in
    # this very step; the hitting rows (a chunk and a decode) must read them.
    sequences = make_sequences({"early": 4, "late": 7, "later": 5})
    early = sequences["early"]
    for name in ("late", "later"):
        seq = sequences[name]
        seq.blocks[0] = early.blocks[0]
        seq.k[:, :BLOCK_SIZE], seq.v[:, :BLOCK_SIZE] = early.k, early.v
    run_step(backend, sequences, [("late", 4, 7), ("early", 0, 4), ("later", 4, 5)])


def test_is_an_attention_backend_registered_as_torch() -> None:
    backend = TorchPagedAttention(spec=SPEC)
    assert isinstance(backend, AttentionBackend)
    assert backend.kv_cache_bytes_per_block() == 2 * LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4
    registered: dict[str, type] = {}
    register_attention_backends(register=registered.__setitem__)
    assert registered == {"torch": TorchPagedAttention}


def test_forward_before_prepare_is_an_error() -> None:
    backend = TorchPagedAttention(spec=SPEC)
    backend.allocate_kv_cache(4)
    q = torch.zeros(1, HEADS, HEAD_DIM)
    k = torch.zeros(1, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="prepare"):
        backend.forward(0, q, k, k)


def one_row_of_three_tokens(seq_len: int, blocks: list[int]) -> AttentionBatch:
    return AttentionBatch(
        query_start_loc=np.array([0, 3], dtype=np.int32),
        seq_lens=np.array([seq_len], dtype=np.int32),
        block_table=np.array([blocks], dtype=np.int32),
        slot_mapping=np.arange(3, dtype=np.int64),
    )


def test_a_row_with_more_query_tokens_than_its_seq_len_is_refused(
    backend: TorchPagedAttention,
) -> None:
    with pytest.raises(ValueError, match="more query tokens than its seq_len"):
        backend.prepare(one_row_of_three_tokens(2, [0]))


@pytest.mark.parametrize(
    ("seq_len", "blocks", "message"),
    [(7, [0], "needs 2 blocks; the table has 1"), (3, [NUM_BLOCKS], "outside the cache")],
    ids=["short-table", "block-outside-cache"],
)
def test_the_native_plan_refuses_blocks_the_cache_cannot_hold(
    seq_len: int, blocks: list[int], message: str
) -> None:
    backend = TorchPagedAttention(spec=SPEC, options=TorchPagedAttention.Options(kernel="native"))
    backend.allocate_kv_cache(NUM_BLOCKS)
    with pytest.raises(ValueError, match=message):
        backend.prepare(one_row_of_three_tokens(seq_len, blocks))


# ----------------------------------------------------------------- one row, two threads


def row_pool_missing() -> str | None:
    """Why a decode row cannot be split over the row pool's helper thread here: the pool is
    core's cpu_ops.cpp's (x86-64 Linux, built wherever there is a compiler), and the native
    kernel splits a row only where it is built with AVX-512F."""
    missing = missing_cpu_flags(("avx512f",))
    return f"the CPU lacks {' and '.join(missing)}" if missing else None


# Skipped only where the CPU lacks the split's instructions: where it has them, a library
# that does not build fails these tests.
ROW_POOL_MISSING = row_pool_missing()
needs_row_pool = pytest.mark.skipif(
    ROW_POOL_MISSING is not None,
    reason=f"splitting a decode row over the helper thread: {ROW_POOL_MISSING}",
)


@pytest.fixture
def two_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def set_row_pool(enabled: bool) -> None:
    assert ops.load(ops.OPS_SOURCE), ops.unavailable_reason(ops.OPS_SOURCE)
    torch.ops.plugserve_ops.row_pool_set_enabled(enabled)


@pytest.fixture
def row_pool_restored() -> Iterator[None]:
    assert ops.load(ops.OPS_SOURCE), ops.unavailable_reason(ops.OPS_SOURCE)
    enabled = torch.ops.plugserve_ops.row_pool_enabled()
    yield
    set_row_pool(enabled)


@dataclass
class DecodeRow:
    """One request's context in scattered blocks of a cache at SmolLM2's heads, its decode
    row's batch, and the row's q, k and v."""

    spec: AttentionSpec
    cache: torch.Tensor
    batch: AttentionBatch
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def backend(self, kernel: str) -> TorchPagedAttention:
        backend = TorchPagedAttention(
            spec=self.spec, options=TorchPagedAttention.Options(kernel=kernel)
        )
        backend.allocate_kv_cache(self.cache.shape[2])
        assert backend.kv_cache is not None
        backend.kv_cache.copy_(self.cache)
        backend.prepare(self.batch)
        return backend


def one_decode_row(
    seq_len: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    layer: LayerAttention = FULL_ATTENTION,
) -> DecodeRow:
    spec = AttentionSpec(
        num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64, block_size=block_size,
        dtype=dtype, device=torch.device("cpu"), layers=(layer,),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    used = -(-seq_len // block_size)
    num_blocks = 2 * used + 1
    blocks = torch.randperm(num_blocks, generator=generator)[:used].numpy().astype(np.int32)
    cache = torch.randn(1, 2, num_blocks, block_size, 3, 64, generator=generator).to(dtype)
    last = seq_len - 1
    batch = AttentionBatch(
        query_start_loc=np.array([0, 1], dtype=np.int32),
        seq_lens=np.array([seq_len], dtype=np.int32),
        block_table=blocks[None, :],
        slot_mapping=np.array([blocks[last // block_size] * block_size + last % block_size]),
    )
    q, k, v = (torch.randn(1, h, 64, generator=generator).to(dtype) for h in (9, 3, 3))
    return DecodeRow(spec, cache, batch, (q, k, v))


@needs_row_pool
@pytest.mark.usefixtures("two_threads", "row_pool_restored")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 63 stays on one thread; from 64 each KV head's context is split in two slices, the
# second shorter (65, 100) or one run of 16 tokens (80).
@pytest.mark.parametrize("seq_len", [63, 64, 65, 80, 100, 299, 1000])
@pytest.mark.parametrize("block_size", [16, 5])
# With a window of 70 the row reads its last 70 tokens (split from 64 on, as without):
# the slices then start mid-context.
@pytest.mark.parametrize(
    "layer",
    [FULL_ATTENTION, LayerAttention(sliding_window=70, logit_softcap=3.0, scale=0.2)],
    ids=["full", "window-softcap-scale"],
)
def test_a_decode_row_shared_with_the_matmul_helper_matches_one_thread(
    dtype: torch.dtype, seq_len: int, block_size: int, layer: LayerAttention
) -> None:
    """At batch 1 the row's context is split between the caller and the one-row matmuls'
    helper thread (row_pool.h), each slice's softmax merged after: the same attention as
    the one thread computes, up to fp32 rounding (and one bf16 rounding of the output)."""
    row = one_decode_row(seq_len, block_size, dtype, seed=seq_len, layer=layer)
    native = row.backend("native")
    set_row_pool(False)
    alone = native.forward(0, *row.qkv).float()
    set_row_pool(True)
    jobs_before = torch.ops.plugserve_ops.row_pool_jobs_shared()
    shared = native.forward(0, *row.qkv).float()
    # One job offered to the helper from 64 tokens on; below, the caller alone.
    assert torch.ops.plugserve_ops.row_pool_jobs_shared() - jobs_before == (seq_len >= 64)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(shared, alone, atol=tolerance, rtol=tolerance)
    expected = row.backend("sdpa").forward(0, *row.qkv).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(shared, expected, atol=tolerance, rtol=tolerance)


# The longest a helper held on a slice waits for row_pool_release_helper: a liveness bound,
# reached only by a caller that waits for its helper instead of taking the slice over.
HELPER_HOLD_US = 1_000_000


@needs_row_pool
@pytest.mark.usefixtures("two_threads", "row_pool_restored")
def test_a_decode_row_whose_helper_is_displaced_is_finished_by_the_caller() -> None:
    """The helper held on its first slice until released: the caller computes that slice
    itself and returns with the right output; the helper's result, ready after its
    release, is dropped, so the rows attended meanwhile (other q) stay right too."""
    pool = torch.ops.plugserve_ops
    row = one_decode_row(400, 16, torch.bfloat16, seed=3)
    backend, (q, k, v) = row.backend("native"), row.qkv
    others = [torch.randn_like(q) for _ in range(4)]
    set_row_pool(True)
    expected = backend.forward(0, q, k, v)
    expected_others = [backend.forward(0, other, k, v) for other in others]
    try:
        # Tries until the helper has taken a slice: an idle-class thread on a busy machine may
        # need hundreds (the deadline is for liveness only).
        deadline = time.monotonic() + 30
        while True:
            backend.forward(0, others[0], k, v)  # the helper is awake (it sleeps after 50 us)
            taken = pool.row_pool_items_taken_over()
            dropped = pool.row_pool_late_items_dropped()
            pool.row_pool_stall_helper_once(HELPER_HOLD_US)
            out = backend.forward(0, q, k, v)
            if pool.row_pool_items_taken_over() > taken:
                break
            pool.row_pool_release_helper()  # it took no slice of this row: again
            assert time.monotonic() < deadline, "the helper took no slice, or the caller waited"
        # The caller took over the slice the helper held, and computed it itself.
        assert pool.row_pool_items_taken_over() == taken + 1
        assert torch.equal(out, expected)
        later = [backend.forward(0, other, k, v) for other in others for _ in range(10)]
        pool.row_pool_release_helper()
        later += [backend.forward(0, other, k, v) for other in others for _ in range(10)]
        deadline = time.monotonic() + 30  # liveness only: it is back within microseconds
        while pool.row_pool_late_items_dropped() == dropped:
            assert time.monotonic() < deadline, "the released helper kept the slice it had lost"
            time.sleep(0.001)
        assert all(torch.equal(o, expected_others[i // 10 % 4]) for i, o in enumerate(later))
    finally:
        pool.row_pool_release_helper()
