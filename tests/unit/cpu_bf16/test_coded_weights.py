"""The exponent-coded copy of a packed bf16 weight (cpu_gemm.h, exponent_coding.code_exponents).

A one-row matmul reads it instead of the packed weight: 12 bits a weight where a 16-column
block uses at most 16 exponents. It is lossless and summed in the plain kernel's order,
so every result is the plain kernel's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from plugserve import ops
from plugserve_plugins.cpu_bf16 import cpu_features, exponent_coding, packed_linear, weight_arena
from plugserve_plugins.cpu_bf16.kernel_plan import OWN, OWN_CODED, ROW_BUCKETS, KernelPlan

# cpu_gemm.cpp forced wherever this CPU can run it (conftest.py), else skipped saying why.
pytestmark = pytest.mark.usefixtures("own_kernel")

UNCODED = 0xFFFF


def trained_like(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Weights whose exponents are as few as a trained model's (SmolLM2: 13-20 a matrix):
    normal values clipped to a range and small ones flushed to zero."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    weight = weight.clamp(-0.4, 0.4)
    weight[weight.abs() < 2e-4] = 0
    return weight.bfloat16()


def table_of(coded: torch.Tensor) -> torch.Tensor:
    """Each block's 32 table entries, as unsigned 16-bit values."""
    return (
        coded[:, : exponent_coding.CODED_TABLE_BYTES].contiguous().view(torch.int16).int() & 0xFFFF
    )


def decode(coded: torch.Tensor, pairs: int) -> torch.Tensor:
    """The reference decoder: a coded weight → the packed bf16 bits [blocks, pairs, 32]."""
    blocks = coded.shape[0]
    table = table_of(coded)
    groups = coded[:, exponent_coding.CODED_TABLE_BYTES :].reshape(blocks, pairs // 2, 3, 32).int()
    bits = torch.empty(blocks, pairs, 32, dtype=torch.int32)
    for half, (index, sign_mantissa) in enumerate(
        [(groups[:, :, 0] & 0xF, groups[:, :, 1]), (groups[:, :, 0] >> 4, groups[:, :, 2])]
    ):
        exponent = table.gather(1, index.reshape(blocks, -1)).reshape(index.shape)
        bits[:, half::2] = (sign_mantissa >> 1) | ((sign_mantissa & 1) << 15) | exponent
    return bits


def packed_bits(packed: torch.Tensor) -> torch.Tensor:
    return packed.reshape(packed.shape[0], packed.shape[1], 32).view(torch.int16).int() & 0xFFFF


def test_coding_is_lossless_for_blocks_of_at_most_sixteen_exponents() -> None:
    weight = trained_like(64, 576, seed=0)
    used = torch.unique((packed_bits(weight_arena.pack_k_pairs(weight[16:32])) >> 7) & 0xFF)
    for extra in range(17 - used.numel()):  # block 1: one exponent too many, so uncoded
        weight[20, 7 + extra] = 2.0 ** (10 + extra)
    packed = weight_arena.pack_k_pairs(weight)
    coded = exponent_coding.code_exponents(packed)

    assert coded.dtype == torch.uint8
    assert coded.shape == (4, exponent_coding.coded_block_bytes(576))
    assert exponent_coding.coded_block_bytes(576) == 64 + 576 // 4 * 96  # 12 bits a weight, + table
    uncoded = table_of(coded)[:, 0] == UNCODED
    assert uncoded.tolist() == [False, True, False, False]
    assert torch.equal(decode(coded, 288)[~uncoded], packed_bits(packed)[~uncoded])
    table = table_of(coded)[~uncoded]
    assert torch.equal(table[:, :16], table[:, 16:])  # the kernel's lookups ignore bit 4
    assert (table[:, 0] >> 15 == 0).all()  # no real entry looks like the uncoded mark


@pytest.fixture(params=[True, False], ids=["row-pool", "openmp"])
def one_row_threads(request: pytest.FixtureRequest, own_kernel: None) -> Iterator[None]:
    """One-row matmuls on the row pool's helper (as in an engine process), or on OpenMP's
    threads (a process whose OpenMP spins long)."""
    torch.ops.plugserve_ops.row_pool_set_enabled(request.param)
    yield
    torch.ops.plugserve_ops.row_pool_set_enabled(cpu_features.openmp_spins_briefly())


@pytest.mark.usefixtures("one_row_threads")
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(960, 576), (576, 1536), (100, 64), (40, 12), (16, 4), (49152, 576)],
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_one_row_through_the_coded_copy_gives_the_plain_kernels_bits(
    out_features: int, in_features: int, with_bias: bool, out_dtype: torch.dtype | None
) -> None:
    # 12 inputs are 6 k-pairs, a tail the plain loop gives to one chain: so does the coded.
    weight = trained_like(out_features, in_features, seed=out_features + in_features)
    # Block 0 uncoded (32 exponents): read from its record and the packed copy.
    weight[:16, :2] = (2.0 ** torch.arange(-16, 16)).reshape(16, 2)
    packed = weight_arena.pack_k_pairs(weight)
    coded = exponent_coding.code_exponents(packed)
    assert table_of(coded)[0, 0] == UNCODED
    bias = torch.randn(out_features) if with_bias else None
    op = torch.ops.plugserve_gemm.linear_bf16
    for seed in range(3):
        x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(seed))
        x = x.bfloat16()
        plain = op(x, packed, out_features, bias, out_dtype)
        assert torch.equal(op(x, packed, out_features, bias, out_dtype, coded), plain)


def test_an_uncoded_block_streams_its_first_pairs_from_its_record() -> None:
    """A block of more than 16 exponents keeps its first k-pairs plain in its record, so a
    one-row stream reads the coded copy straight on; only the rest comes from the packed
    weight."""
    weight = trained_like(32, 576, seed=8)
    weight[3, :20] = 2.0 ** torch.arange(-10, 10)  # block 0: 20 more exponents, so uncoded
    packed = weight_arena.pack_k_pairs(weight)
    coded = exponent_coding.code_exponents(packed)
    assert (table_of(coded)[:, 0] == UNCODED).tolist() == [True, False]
    in_record = 288 * 3 // 4  # 216 of 288 k-pairs: as many 64-byte vectors as the record holds
    record = coded[0, exponent_coding.CODED_TABLE_BYTES :].view(torch.int16)
    assert torch.equal(
        record[: in_record * 32], packed[0, :in_record].reshape(-1).view(torch.int16)
    )

    op = torch.ops.plugserve_gemm.linear_bf16
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(0)).bfloat16()
    expected = op(x, packed, 32, None)
    head_spoiled, rest_spoiled = packed.clone(), packed.clone()
    head_spoiled[0, :in_record] = 7.0  # not read: the record has these
    rest_spoiled[0, in_record:] = 7.0  # read from here
    assert torch.equal(op(x, head_spoiled, 32, None, None, coded), expected)
    assert not torch.equal(op(x, rest_spoiled, 32, None, None, coded)[0, :16], expected[0, :16])


def test_one_row_reads_the_coded_copy_and_several_rows_the_packed_one() -> None:
    weight = trained_like(96, 64, seed=5)
    packed = weight_arena.pack_k_pairs(weight)
    garbage = torch.full_like(exponent_coding.code_exponents(packed), 0x55)  # decodes to nonsense
    op = torch.ops.plugserve_gemm.linear_bf16
    row = torch.randn(1, 64).bfloat16()
    # Equal results alone would also hold if the coded copy were never read.
    assert not torch.equal(op(row, packed, 96, None, None, garbage), op(row, packed, 96, None))
    rows = torch.randn(5, 64).bfloat16()
    assert torch.equal(op(rows, packed, 96, None, None, garbage), op(rows, packed, 96, None))


def test_a_coded_copy_of_the_wrong_size_is_rejected() -> None:
    packed = weight_arena.pack_k_pairs(trained_like(32, 16, seed=6))
    coded = exponent_coding.code_exponents(packed)
    op = torch.ops.plugserve_gemm.linear_bf16
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="coded must be uint8"):
        op(x, packed, 32, None, None, coded[:1])
    with pytest.raises(RuntimeError, match="K divisible by 4"):
        exponent_coding.code_exponents(weight_arena.pack_k_pairs(trained_like(32, 18, seed=7)))


def test_an_arena_holds_coded_copies_only_where_the_plan_reads_them() -> None:
    weights = [trained_like(n, k, seed=n) for n, k in [(40, 64), (48, 70), (960, 576)]]
    plain = KernelPlan.single(OWN)
    plain_arena = weight_arena.WeightArena.for_weights(weights, plain)
    assert plain_arena is not None
    assert all(
        packed_linear.PackedLinear(w, arena=plain_arena, plan=plain).coded is None for w in weights
    )

    coded = KernelPlan((OWN_CODED,) + (OWN,) * (len(ROW_BUCKETS) - 1))
    arena = weight_arena.WeightArena.for_weights(weights, coded)
    assert arena is not None
    first, odd, last = (packed_linear.PackedLinear(w, arena=arena, plan=coded) for w in weights)
    assert odd.own_kernel and odd.coded is None  # 70 inputs: 35 k-pairs, not whole groups
    assert first.coded is not None and last.coded is not None
    assert first.coded.data_ptr() % ops.HUGE_PAGE_BYTES == 0
    assert last.coded.data_ptr() == first.coded.data_ptr() + first.coded.numel()
    x = torch.randn(1, 576).bfloat16()
    assert torch.equal(last(x), torch.ops.plugserve_gemm.linear_bf16(x, last.weight, 960, None))
