"""The fused CPU ops (cpu_ops.cpp) against the ATen formulas they replace.

In float32 each op equals its formula up to summation order; in bfloat16 each equals the
float32 result rounded once to bfloat16 (the op computes in fp32 and rounds on store),
which is at least as close to the fp32 reference as ATen's op-by-op bf16 rounding.
"""

from __future__ import annotations

import bisect
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plugserve.worker import cpu_ops
from plugserve.worker.layers.rotary import RotaryEmbedding, rope_inv_freq

MISSING = cpu_ops.unavailable_reason()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"cpu_ops.cpp: {MISSING}")

HIDDEN, EPS = 576, 1e-5
DTYPES = [torch.float32, torch.bfloat16]


def close(actual: torch.Tensor, expected_fp32: torch.Tensor) -> None:
    """float32: equal within summation order; bfloat16: the fp32 value rounded once, give or
    take one bf16 step where the fp32 results differ in the last bits before rounding."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected_fp32, atol=1e-5, rtol=1e-5)
        return
    rounded = expected_fp32.to(actual.dtype)
    ulp = torch.finfo(actual.dtype).eps * expected_fp32.abs().clamp_min(1e-3)
    assert ((actual.float() - rounded.float()).abs() <= ulp).all()
    assert (actual == rounded).float().mean() > 0.99


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_matches_aten(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    close(cpu_ops.rms_norm(x, weight, EPS), reference_rms_norm(x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_fused_add_rms_norm_updates_both_in_place(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, HIDDEN).to(dtype), torch.randn(rows, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    summed = x + residual  # what an unfused add stores, rounded to dtype
    out_x, out_residual = x.clone(), residual.clone()

    normed, new_residual = cpu_ops.fused_add_rms_norm(out_x, out_residual, weight, EPS)

    assert normed.data_ptr() == out_x.data_ptr()
    assert new_residual.data_ptr() == out_residual.data_ptr()
    assert torch.equal(new_residual, summed)
    close(normed, reference_rms_norm(summed, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 1539])  # 16 lanes at a time, and a scalar tail
def test_silu_and_mul_matches_aten(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(9, 2 * width) * 4
    # Far past exp's range both ways, where the vector exp clamps: SiLU is 0 and g.
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -88.0, -87.0, 87.0, 88.0, 90.0, 200.0])
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    close(cpu_ops.silu_and_mul(gate_up), F.silu(gate) * up)


def bf16_value(pattern: int) -> float:
    """The value of a bf16 bit pattern, decoded from its fields with integers (widening a
    subnormal through float reads it as zero on a thread with DAZ set)."""
    sign = -1.0 if pattern & 0x8000 else 1.0
    exponent, fraction = (pattern >> 7) & 0xFF, pattern & 0x7F
    if exponent == 0xFF:
        return sign * math.inf if fraction == 0 else math.nan
    if exponent == 0:
        return sign * math.ldexp(fraction, -133)
    return sign * math.ldexp(0x80 | fraction, exponent - 134)


# Every non-negative finite bf16 value in pattern order (which is value order), then 2^128
# for infinity's pattern: a value rounds to infinity where 2^128 is nearer, ties to even.
MAGNITUDES = [bf16_value(p) for p in range(0x7F80)] + [math.ldexp(1.0, 128)]


def nearest_bf16_pattern(g: float) -> int:
    """The bf16 pattern nearest to float64 g, ties to the even pattern: rounded once."""
    sign = 0x8000 if math.copysign(1.0, g) < 0 else 0
    if math.isnan(g):
        return 0x7FC0
    hi = bisect.bisect_left(MAGNITUDES, abs(g))
    if hi == len(MAGNITUDES) or MAGNITUDES[hi] == abs(g):
        return sign | min(hi, 0x7F80)
    # Both differences are exact: neighbours lie within a factor of two of abs(g).
    below, above = abs(g) - MAGNITUDES[hi - 1], MAGNITUDES[hi] - abs(g)
    nearer = hi - 1 if below < above or (below == above and (hi - 1) % 2 == 0) else hi
    return sign | nearer


def gelu_float64(v: float, tanh_form: bool) -> float:
    """GELU in float64, as x sigmoid(2y) and x/2 erfc(-x / sqrt 2): forms that keep their
    accuracy far below zero, where 1 + tanh and 1 + erf cancel."""
    if not tanh_form:
        return 0.5 * v * math.erfc(-v / math.sqrt(2))
    t = 2 * math.sqrt(2 / math.pi) * (v + 0.044715 * v**3) if math.isfinite(v) else v
    sigmoid = 1 / (1 + math.exp(-t)) if t >= 0 else math.exp(t) / (1 + math.exp(t))
    return v * sigmoid


def expected_gelu_patterns(tanh_form: bool) -> torch.Tensor:
    """int16 [65536]: for each bf16 pattern from 0x8000 up through 0x7FFF (as int16 counts),
    its GELU's pattern; NaN where GELU is NaN (a NaN, and -inf: -inf * 0)."""
    patterns = [p & 0xFFFF for p in range(-(2**15), 2**15)]
    out = [nearest_bf16_pattern(gelu_float64(bf16_value(p), tanh_form)) for p in patterns]
    return torch.tensor(out, dtype=torch.int32).to(torch.int16)


def every_bf16_pattern_with_a_tail() -> torch.Tensor:
    """All 65536 bf16 patterns as rows of 16, each row with its first 5 again (21 wide: one
    16-lane vector and a scalar tail of 5)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    every = bits.view(torch.bfloat16).reshape(-1, 16)
    return torch.cat([every, every[:, :5]], dim=1).contiguous()


def assert_gelu_of_every_pattern(x: torch.Tensor, tanh_form: bool) -> None:
    """x: every_bf16_pattern_with_a_tail() after GELU; each value is the float64 GELU of
    its input rounded once to bf16, bit for bit (zero's sign included), NaN where NaN."""
    expected = expected_gelu_patterns(tanh_form).reshape(-1, 16)
    expected = torch.cat([expected, expected[:, :5]], dim=1)
    nan = expected.view(torch.bfloat16).isnan()
    assert torch.equal(x.isnan(), nan)
    assert torch.equal(x.view(torch.int16)[~nan], expected[~nan])


@pytest.mark.parametrize("tanh_form", [False, True])
def test_gelu_is_every_bf16_value_gelu_rounded_once_in_place(tanh_form: bool) -> None:
    x = every_bf16_pattern_with_a_tail()

    out = cpu_ops.gelu_(x, tanh_form)

    assert out.data_ptr() == x.data_ptr()
    assert_gelu_of_every_pattern(out, tanh_form)


FLUSHING_THREAD = """
import sys, threading, torch
from plugserve.worker import cpu_ops
sys.path.insert(0, sys.argv[1])
from test_cpu_ops import every_bf16_pattern_with_a_tail

def gelu_on_the_loading_thread():
    assert cpu_ops.load()
    tiny = sys.float_info.min / 2
    flushes = tiny * 1.0 == 0.0
    x = every_bf16_pattern_with_a_tail()
    forms = [cpu_ops.gelu_(x.clone(), tanh_form) for tanh_form in (False, True)]
    torch.save({"flushes": flushes, "forms": forms}, sys.argv[2])

thread = threading.Thread(target=gelu_on_the_loading_thread)
thread.start()
thread.join()
"""


def test_gelu_tables_built_on_a_thread_that_flushes_subnormals_are_the_same(tmp_path) -> None:
    """Loading a -ffast-math library turns on FTZ/DAZ on the loading thread (GCC's
    crtfastmath); a table first built there still holds every subnormal's GELU."""
    result = tmp_path / "gelu.pt"
    subprocess.run(
        [sys.executable, "-c", FLUSHING_THREAD, str(Path(__file__).parent), str(result)],
        check=True,
        timeout=300,
    )
    built = torch.load(result)
    if not built["flushes"]:
        pytest.skip("this compiler's -ffast-math libraries leave FTZ/DAZ off")
    for tanh_form, x in zip((False, True), built["forms"], strict=True):
        assert_gelu_of_every_pattern(x, tanh_form)


def test_gelu_takes_bf16_only() -> None:
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        cpu_ops.gelu_(torch.zeros(2, 16), False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_layer_norm_normalizes_the_unrounded_sum_in_place(
    dtype: torch.dtype, rows: int
) -> None:
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, 384).to(dtype), torch.randn(rows, 384).to(dtype)
    weight, bias = torch.randn(384).to(dtype), torch.randn(384).to(dtype)
    summed = x.float() + residual.float()
    expected = F.layer_norm(summed, (384,), weight.float(), bias.float(), EPS)
    kept = residual.clone()

    out = cpu_ops.add_layer_norm_(x, residual, weight, bias, EPS)

    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(residual, kept)
    close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_rotates_q_and_k_in_place_and_leaves_v(dtype: torch.dtype) -> None:
    """The fused op on the QKV output rows (q and k heads rotated, v untouched) equals the
    rotate-half formula applied to q and k in fp32."""
    head_dim, heads, kv_heads = 64, 9, 3
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, {"rope_type": "default"})
    torch.manual_seed(0)
    positions = torch.tensor([0, 5, 17, 4095, 1000])
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * head_dim).to(dtype)
    qk_heads = heads + kv_heads
    # Hugging Face's formula: x * cos + rotate_half(x) * sin, in fp32.
    freqs = positions[:, None].float() * rope_inv_freq(head_dim, 10000.0, {"rope_type": "default"})
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    x = qkv[:, : qk_heads * head_dim].float().view(-1, qk_heads, head_dim)
    rotate_half = torch.cat((-x[..., head_dim // 2 :], x[..., : head_dim // 2]), dim=-1)
    expected = x * emb.cos() + rotate_half * emb.sin()
    v_before = qkv[:, qk_heads * head_dim :].clone()

    rotary.use_fused_op()
    assert rotary.cos_sin is not None
    cpu_ops.rotary_embedding(qkv, positions, rotary.cos_sin, qk_heads, head_dim)

    close(qkv[:, : qk_heads * head_dim].view(-1, qk_heads, head_dim), expected)
    assert torch.equal(qkv[:, qk_heads * head_dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_partial_rotary_table_rotates_each_heads_first_part_as_the_aten_path(
    dtype: torch.dtype,
) -> None:
    """A table rotary_dim wide (Phi-4-mini's partial rotary factor) rotates each head's
    first rotary_dim dimensions as RotaryEmbedding's own forward does and leaves the rest
    and v as they were."""
    head_dim, heads, kv_heads = 16, 4, 2
    rotary = RotaryEmbedding(head_dim, 64, 500.0, {"rope_type": "default"}, rotary_dim=12)
    torch.manual_seed(0)
    positions = torch.tensor([0, 3, 7, 63])
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * head_dim).to(dtype)
    qk_heads = heads + kv_heads
    expected = rotary(qkv.float(), rotary.prepare(positions, torch.float32), qk_heads)
    before = qkv.clone()

    rotary.use_fused_op()
    assert rotary.cos_sin is not None and rotary.cos_sin.shape == (64, 12)
    cpu_ops.rotary_embedding(qkv, positions, rotary.cos_sin, qk_heads, head_dim)

    by_head = qkv[:, : qk_heads * head_dim].view(-1, qk_heads, head_dim)
    close(by_head, expected)
    assert torch.equal(
        by_head[..., 12:], before[:, : qk_heads * head_dim].view_as(by_head)[..., 12:]
    )
    assert torch.equal(qkv[:, qk_heads * head_dim :], before[:, qk_heads * head_dim :])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_heads_normalizes_each_head_of_the_range_in_place(dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: each head of [first, first + count) of every row, RMS-normalized
    over head_dim times the shared weight; the other heads untouched."""
    head_dim, heads = 16, 8
    torch.manual_seed(0)
    x = torch.randn(5, heads * head_dim).to(dtype)
    weight = (torch.randn(head_dim) + 1).to(dtype)
    before = x.clone()

    cpu_ops.rms_norm_heads(x, weight, EPS, 2, 3, head_dim)

    by_head, was = x.view(5, heads, head_dim), before.view(5, heads, head_dim)
    close(
        by_head[:, 2:5],
        reference_rms_norm(was[:, 2:5].reshape(-1, head_dim), weight).view(5, 3, -1),
    )
    assert torch.equal(by_head[:, :2], was[:, :2]) and torch.equal(by_head[:, 5:], was[:, 5:])
    with pytest.raises(RuntimeError, match="must hold heads"):
        cpu_ops.rms_norm_heads(x, weight, EPS, 6, 3, head_dim)


def test_rotary_embedding_rejects_a_position_beyond_the_table() -> None:
    rotary = RotaryEmbedding(64, 128, 10000.0, {"rope_type": "default"})
    rotary.use_fused_op()
    assert rotary.cos_sin is not None
    qkv = torch.zeros(2, 3 * 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        cpu_ops.rotary_embedding(qkv, torch.tensor([3, 128]), rotary.cos_sin, 2, 64)


def test_ops_reject_mismatched_shapes() -> None:
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        cpu_ops.rms_norm(torch.zeros(2, 8), torch.zeros(4), EPS)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        cpu_ops.silu_and_mul(torch.zeros(2, 9))
    with pytest.raises(RuntimeError, match="residual must match x"):
        cpu_ops.add_layer_norm_(
            torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), torch.zeros(8), EPS
        )
    with pytest.raises(RuntimeError, match="bias must be contiguous"):
        cpu_ops.add_layer_norm_(
            torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), torch.zeros(4), EPS
        )


def test_argmax_is_torchs_first_index_of_the_maximum() -> None:
    torch.manual_seed(0)
    logits = torch.randn(33, 49152)
    logits[1, 7] = logits[1, 900] = 1e6  # a tie: the first index wins
    logits[2, -1] = 1e6  # the last column
    logits[3, 5] = float("nan")  # NaN counts as the maximum, as in torch
    assert torch.equal(cpu_ops.argmax(logits), logits.argmax(dim=-1))
    assert cpu_ops.argmax(logits)[1:4].tolist() == [7, 49151, 5]
    # A strided view (rows of a wider tensor) and a single row.
    wide = torch.randn(4, 100)
    assert torch.equal(cpu_ops.argmax(wide[:, :60]), wide[:, :60].argmax(dim=-1))
    assert torch.equal(cpu_ops.argmax(logits[:1]), logits[:1].argmax(dim=-1))
