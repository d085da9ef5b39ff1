"""A stretch of the layer stack (cpu_decoder.cpp's decode_stretch) against the ops it fuses,
called one by one: Llama's stretch, and the next layer's variants (Qwen3's q/k norm, no
rotation in a NoPE layer, a partial rotary factor)."""

from __future__ import annotations

import pytest
import torch

from plugserve.worker import cpu_ops
from plugserve_plugins.cpu_bf16 import cpu_features, packed_linear, weight_arena
from plugserve_plugins.cpu_bf16.kernel_plan import (
    OWN,
    OWN_CACHED,
    OWN_CODED,
    OWN_TILED,
    ROW_BUCKETS,
    Kernel,
    KernelPlan,
)

OPS_MISSING = cpu_ops.unavailable_reason()
DECODER_MISSING = cpu_features.decoder_unavailable_reason()
pytestmark = [
    # cpu_gemm.cpp forced wherever this CPU can run it (conftest.py), else skipped saying why.
    pytest.mark.usefixtures("own_kernel"),
    pytest.mark.skipif(OPS_MISSING is not None, reason=f"cpu_ops.cpp: {OPS_MISSING}"),
    pytest.mark.skipif(DECODER_MISSING is not None, reason=f"cpu_decoder.cpp: {DECODER_MISSING}"),
]

TOKENS, HIDDEN, INTER, HEAD_DIM, Q_HEADS, KV_HEADS, EPS = 3, 64, 96, 16, 4, 2, 1e-5
QKV = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM


def bf16(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape) * 0.3).to(torch.bfloat16)


def make_args(last: bool, one_row: Kernel = OWN) -> dict[str, object]:
    """One layer's weights, packed in an arena for a plan whose one-row kernel is
    `one_row` (with exponent-coded copies where it reads them)."""
    torch.manual_seed(0)
    shapes = [(HIDDEN, Q_HEADS * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER), (QKV, HIDDEN)]
    weights = [bf16(*shape) for shape in shapes]
    plan = KernelPlan((one_row,) + (OWN,) * (len(ROW_BUCKETS) - 1))
    arena = weight_arena.WeightArena.for_weights(weights, plan)
    o_bias, qkv_bias = bf16(HIDDEN), bf16(QKV)
    o, gate_up, down, qkv = (
        packed_linear.PackedLinear(w, bias, arena=arena, plan=plan)
        for w, bias in zip(weights, [o_bias, None, None, qkv_bias], strict=True)
    )
    return {
        "plan": plan,
        "o": o,
        "post_norm": bf16(HIDDEN),
        "gate_up": gate_up,
        "down": down,
        "next_norm": bf16(HIDDEN),
        "qkv": None if last else qkv,
        "cos_sin": torch.randn(32, HEAD_DIM),
        # The next layer's q/k norm weights (None: none), and whether it rotates.
        "q_norm": None,
        "k_norm": None,
        "rotates": True,
    }


# The next layer's variants: what a stretch does to its qkv before attention.
VARIANTS = {
    "llama": {},
    "qk-norm": {"q_norm": "weight", "k_norm": "weight"},
    "no-rotation": {"rotates": False},
    "partial-rotary": {"cos_sin": "half"},
    "qk-norm-no-rotation": {"q_norm": "weight", "k_norm": "weight", "rotates": False},
}


def variant(a: dict, name: str) -> dict:
    """`a` with the next layer's variant `name` (VARIANTS)."""
    torch.manual_seed(1)
    made = {}
    for key, value in VARIANTS[name].items():
        if value == "weight":
            made[key] = bf16(HEAD_DIM) + 1
        elif value == "half":  # rotating each head's first half, the rest passed through
            made[key] = torch.randn(32, HEAD_DIM // 2)
        else:
            made[key] = value
    return {**a, **made}


def call_op(a: dict, attention_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """A one-layer LayerStack of these weights, its stretch run by decode_stretch."""
    qkv = a["qkv"]
    stack = torch.classes.plugserve_decoder.LayerStack(a["cos_sin"], Q_HEADS, KV_HEADS, HEAD_DIM)
    stack.add_layer(
        0, a["o"].weight, a["o"].own_bias, a["post_norm"],
        a["gate_up"].weight, a["gate_up"].own_bias, a["down"].weight, a["down"].own_bias,
        a["next_norm"], EPS,
        None if qkv is None else qkv.weight, None if qkv is None else qkv.own_bias,
        0 if qkv is None else qkv.out_features,
        a["o"].coded, a["gate_up"].coded, a["down"].coded,
        None if qkv is None else qkv.coded,
        a["q_norm"], a["k_norm"], EPS, a["rotates"],
    )  # fmt: skip
    positions = torch.tensor([3, 0, 17])[: attention_out.shape[0]]
    mode = a["plan"].for_rows(attention_out.shape[0]).one_row_mode
    return torch.ops.plugserve_decoder.decode_stretch(
        stack, 0, attention_out, residual, positions, mode
    )


def one_by_one(a: dict, attention_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    h = a["o"](attention_out)
    cpu_ops.fused_add_rms_norm(h, residual, a["post_norm"], EPS)
    m = a["down"](cpu_ops.silu_and_mul(a["gate_up"](h)))
    cpu_ops.fused_add_rms_norm(m, residual, a["next_norm"], EPS)
    if a["qkv"] is None:
        return m
    qkv = a["qkv"](m)
    if a["q_norm"] is not None:
        cpu_ops.rms_norm_heads(qkv, a["q_norm"], EPS, 0, Q_HEADS, HEAD_DIM)
        cpu_ops.rms_norm_heads(qkv, a["k_norm"], EPS, Q_HEADS, KV_HEADS, HEAD_DIM)
    if a["rotates"]:
        cpu_ops.rotary_embedding(
            qkv,
            torch.tensor([3, 0, 17])[: qkv.shape[0]],
            a["cos_sin"],
            Q_HEADS + KV_HEADS,
            HEAD_DIM,
        )
    return qkv


@pytest.mark.parametrize("next_layer", list(VARIANTS))
@pytest.mark.parametrize("last", [False, True], ids=["to-next-qkv", "last-layer"])
def test_equals_the_ops_it_fuses_in_their_order(last: bool, next_layer: str) -> None:
    a = variant(make_args(last), next_layer)
    attention_out, residual = bf16(TOKENS, Q_HEADS * HEAD_DIM), bf16(TOKENS, HIDDEN)
    expected_residual = residual.clone()
    expected = one_by_one(a, attention_out, expected_residual)

    actual = call_op(a, attention_out, residual)

    assert actual.shape == ((TOKENS, HIDDEN) if last else (TOKENS, QKV))
    assert torch.equal(actual, expected)
    assert torch.equal(residual, expected_residual)  # the residual stream, in place


@pytest.mark.parametrize("one_row", [OWN, OWN_CACHED, OWN_TILED, OWN_CODED], ids=lambda k: k.name)
@pytest.mark.parametrize("last", [False, True], ids=["to-next-qkv", "last-layer"])
def test_one_token_runs_the_plans_one_row_kernel_as_the_ops_do(last: bool, one_row: Kernel) -> None:
    """Each one-row kernel a plan may choose gives, inside the stretch, the bits that kernel
    gives called op by op."""
    a = make_args(last, one_row)
    attention_out, residual = bf16(1, Q_HEADS * HEAD_DIM), bf16(1, HIDDEN)
    expected_residual = residual.clone()
    expected = one_by_one(a, attention_out, expected_residual)
    assert torch.equal(call_op(a, attention_out, residual), expected)
    assert torch.equal(residual, expected_residual)


@pytest.mark.parametrize("last", [False, True], ids=["to-next-qkv", "last-layer"])
def test_one_token_through_coded_weights_gives_the_same_bits(last: bool) -> None:
    plain, coded = make_args(last), make_args(last, OWN_CODED)
    assert coded["down"].coded is not None and plain["down"].coded is None
    attention_out, residual = bf16(1, Q_HEADS * HEAD_DIM), bf16(1, HIDDEN)
    original, coded_residual = residual.clone(), residual.clone()
    expected = call_op(plain, attention_out, residual)
    assert torch.equal(call_op(coded, attention_out, coded_residual), expected)
    assert torch.equal(coded_residual, residual)
    # The stretch does read the coded copies (equal bits alone would not show it).
    assert torch.equal(call_op(coded, attention_out, original.clone()), expected)
    coded["down"].coded.fill_(0x55)
    assert not torch.equal(call_op(coded, attention_out, original.clone()), expected)


def test_rejects_a_norm_weight_of_another_width_and_a_position_past_the_table() -> None:
    a = make_args(last=False)
    attention_out, residual = bf16(TOKENS, Q_HEADS * HEAD_DIM), bf16(TOKENS, HIDDEN)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        call_op({**a, "next_norm": bf16(HIDDEN // 2)}, attention_out, residual)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        call_op({**a, "cos_sin": torch.randn(4, HEAD_DIM)}, attention_out, residual)
    stack = torch.classes.plugserve_decoder.LayerStack(a["cos_sin"], Q_HEADS, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="layer 0 is not in the stack"):
        torch.ops.plugserve_decoder.decode_stretch(
            stack, 0, attention_out, residual, torch.tensor([3, 0, 17]), OWN.one_row_mode
        )


def test_the_next_layers_variants_change_its_qkv_as_their_ops_do() -> None:
    """The variants are not a no-op the comparison above could miss: each gives another
    qkv than Llama's stretch, and a partial rotary table leaves each head's rest as
    projected."""
    a = make_args(last=False)
    attention_out, residual = bf16(TOKENS, Q_HEADS * HEAD_DIM), bf16(TOKENS, HIDDEN)
    outputs = {
        name: call_op(variant(a, name), attention_out, residual.clone()) for name in VARIANTS
    }
    names = list(VARIANTS)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            assert not torch.equal(outputs[first], outputs[second]), (first, second)
    by_head = (-1, Q_HEADS + 2 * KV_HEADS, HEAD_DIM)
    unrotated = outputs["no-rotation"].view(by_head)[..., HEAD_DIM // 2 :]
    assert torch.equal(outputs["partial-rotary"].view(by_head)[..., HEAD_DIM // 2 :], unrotated)


def test_a_q_norm_without_its_k_norm_is_refused() -> None:
    a = {**make_args(last=False), "q_norm": bf16(HEAD_DIM)}
    attention_out, residual = bf16(TOKENS, Q_HEADS * HEAD_DIM), bf16(TOKENS, HIDDEN)
    with pytest.raises(RuntimeError, match="needs both the q and the k weights"):
        call_op(a, attention_out, residual)
