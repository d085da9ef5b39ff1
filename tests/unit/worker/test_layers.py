"""Each layer of plugserve.worker.layers against a plain torch reference, and the weight
loaders: full checkpoint tensors sliced for two tensor-parallel ranks (a fake group whose
all-reduce hands the partial sums to the test), q/k/v and gate/up fused into one weight."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.checkpoint import load_checkpoint
from plugserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from plugserve.worker.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from plugserve.worker.layers.mlp import GatedMLP
from plugserve.worker.layers.norm import RMSNorm
from plugserve.worker.layers.rotary import RotaryEmbedding, rope_inv_freq, rope_parameters
from plugserve.worker.linear_methods import (
    LinearMethodChooser,
    give_linear_methods,
    process_linear_weights,
)
from plugserve.worker.parallel import ParallelContext
from plugserve_plugins.cpu_bf16 import packed_linear

FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class FakeRank(ParallelContext):
    """One rank of a 2-rank group without processes: all_reduce keeps this rank's partial
    sum for the test to add up with the other rank's, and returns it unchanged."""

    partials: list[torch.Tensor] = field(default_factory=list, compare=False)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.partials.append(tensor.clone())
        return tensor


def two_ranks() -> list[FakeRank]:
    return [FakeRank(rank=rank, world_size=2) for rank in range(2)]


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) * 0.3


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# --------------------------------------------------------------------------- norm, rotary


def test_rms_norm_is_the_hugging_face_formula_bit_for_bit_in_fp32() -> None:
    norm = RMSNorm(64, eps=1e-6)
    norm.weight.data = randn(64)
    x, residual = randn(5, 64) * 10, randn(5, 64)
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(norm(x), reference)
    normed, summed = norm.add_and_norm(x, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, norm(x + residual))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
    ids=["linear", "llama3"],
)
def test_scaled_rope_frequencies_are_transformers_own(rope: dict[str, Any]) -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope)
    theta, scaling = rope_parameters(config)
    expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, torch.device("cpu"))
    assert torch.equal(rope_inv_freq(16, theta, scaling), expected)


def test_rope_parameters_read_transformers_4_and_5_configs() -> None:
    old = type("Config", (), {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}})
    assert rope_parameters(old) == (5e5, {"rope_type": "linear", "factor": 2})
    new = type("Config", (), {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert rope_parameters(new) == (1e4, {"rope_type": "default"})
    assert rope_parameters(object()) == (10000.0, {"rope_type": "default"})


def rotate_half_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's apply_rotary_pos_emb on x [T, heads, D] at `positions`."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions[:, None].float() * inv_freq[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None]


def test_rotary_rotates_the_first_heads_of_each_row_as_transformers_does() -> None:
    rotary = RotaryEmbedding(16, 64, 10000.0, {"rope_type": "default"})
    positions = torch.tensor([0, 5, 63, 7])
    qkv = randn(4, 5 * 16)  # 3 q/k heads to rotate, then 2 others left alone
    rotated = rotary(qkv, rotary.prepare(positions, torch.float32), 3)
    reference = rotate_half_reference(qkv[:, :48].view(4, 3, 16), positions, 10000.0)
    torch.testing.assert_close(rotated, reference, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- linears


def test_a_replicated_linear_is_f_linear_and_loads_the_whole_tensor() -> None:
    layer = Linear(8, 6, bias=True)
    weight, bias = randn(6, 8), randn(6)
    load_checkpoint(layer, [("weight", weight), ("bias", bias)], {})
    x = randn(3, 8)
    assert torch.equal(layer(x), F.linear(x, weight, bias))


def test_column_parallel_ranks_hold_their_output_rows() -> None:
    weight, bias, x = randn(7, 8), randn(7), randn(3, 8)
    outputs = []
    for parallel in two_ranks():
        layer = ColumnParallelLinear(8, 7, bias=True, parallel=parallel)
        load_checkpoint(layer, [("weight", weight), ("bias", bias)], {})
        outputs.append(layer(x))
    assert [o.shape[1] for o in outputs] == [4, 3]  # uneven: the first rank takes one more
    torch.testing.assert_close(torch.cat(outputs, -1), F.linear(x, weight, bias))


def test_merged_column_parallel_stacks_each_rank_s_slice_of_every_output() -> None:
    gate, up = randn(9, 8), randn(6, 8)  # unequal, to tell the outputs' offsets apart
    for parallel in two_ranks():
        layer = MergedColumnParallelLinear(8, [9, 6], bias=False, parallel=parallel)
        holder = torch.nn.ModuleDict({"gate_up_proj": layer})  # as a model holds it
        load_checkpoint(holder, [("up_proj.weight", up), ("gate_proj.weight", gate)], FUSED)
        # Each output split on its own: 9 = 5 + 4 rows of gate, 6 = 3 + 3 of up.
        gate_rows, up_rows = [(slice(0, 5), slice(0, 3)), (slice(5, 9), slice(3, 6))][parallel.rank]
        assert torch.equal(layer.weight, torch.cat([gate[gate_rows], up[up_rows]]))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "rows"),
    [
        # 6 query heads in 3 KV groups: rank 0 takes KV heads 0-1 with their 4 q heads.
        (6, 3, [((0, 4), (0, 2)), ((4, 6), (2, 3))]),
        # One KV head for both ranks: replicated, its 4 query heads split.
        (4, 1, [((0, 2), (0, 1)), ((2, 4), (0, 1))]),
    ],
    ids=["kv-groups", "replicated-kv"],
)
def test_qkv_parallel_ranks_hold_their_heads_q_k_and_v_rows(
    heads: int, kv_heads: int, rows: list[Any]
) -> None:
    dim = 4
    q, k, v = randn(heads * dim, 8), randn(kv_heads * dim, 8), randn(kv_heads * dim, 8)
    biases = randn(heads * dim), randn(kv_heads * dim), randn(kv_heads * dim)
    checkpoint = [(f"{n}_proj.weight", w) for n, w in zip("qkv", (q, k, v), strict=True)]
    checkpoint += [(f"{n}_proj.bias", b) for n, b in zip("qkv", biases, strict=True)]
    for parallel, ((q0, q1), (kv0, kv1)) in zip(two_ranks(), rows, strict=True):
        layer = QKVParallelLinear(8, dim, heads, kv_heads, bias=True, parallel=parallel)
        load_checkpoint(torch.nn.ModuleDict({"qkv_proj": layer}), checkpoint, FUSED)
        q_rows, kv_rows = slice(q0 * dim, q1 * dim), slice(kv0 * dim, kv1 * dim)
        assert torch.equal(layer.weight, torch.cat([q[q_rows], k[kv_rows], v[kv_rows]]))
        assert layer.bias is not None
        expected_bias = torch.cat([biases[0][q_rows], biases[1][kv_rows], biases[2][kv_rows]])
        assert torch.equal(layer.bias, expected_bias)


def test_row_parallel_partial_sums_add_up_to_the_layer_with_its_bias_added_once() -> None:
    weight, bias, x = randn(6, 9), randn(6), randn(3, 9)
    outputs, partials = [], []
    for parallel in two_ranks():
        layer = RowParallelLinear(9, 6, bias=True, parallel=parallel)
        load_checkpoint(layer, [("weight", weight), ("bias", bias)], {})
        assert layer.bias is not None and torch.equal(layer.bias, bias)  # whole on every rank
        columns = slice(layer.in_start, layer.in_end)
        outputs.append(layer(x[:, columns]))
        partials += parallel.partials
    assert len(partials) == 2
    torch.testing.assert_close(partials[0] + partials[1] + bias, F.linear(x, weight, bias))
    # With a real all-reduce each rank's output is the sum plus the bias: here its own part.
    torch.testing.assert_close(outputs[0], partials[0] + bias)


# --------------------------------------------------------------------------- attention


class CausalAttentionBackend:
    """The AttentionBackend's forward for one sequence: every token attends causally to
    the tokens of the same call (no KV cache)."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
        return out.transpose(0, 1)


def attention_reference(x: torch.Tensor, w: dict[str, torch.Tensor], heads: int, kv: int):
    """Multi-head causal self-attention with GQA and RoPE, from the separate projections."""
    tokens, dim = x.shape[0], w["q_proj.weight"].shape[0] // heads
    q, k, v = (F.linear(x, w[f"{n}_proj.weight"], w[f"{n}_proj.bias"]) for n in "qkv")
    positions = torch.arange(tokens)
    q = rotate_half_reference(q.view(tokens, heads, dim), positions, 10000.0)
    k = rotate_half_reference(k.view(tokens, kv, dim), positions, 10000.0)
    k, v = (
        k.repeat_interleave(heads // kv, 1),
        v.view(tokens, kv, dim).repeat_interleave(heads // kv, 1),
    )
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
    scores = scores.masked_fill(torch.ones(tokens, tokens).triu(1).bool(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(tokens, heads * dim)
    return F.linear(out, w["o_proj.weight"], w["o_proj.bias"])


def attention_checkpoint(hidden: int, heads: int, kv: int, dim: int) -> dict[str, torch.Tensor]:
    shapes = {"q": heads * dim, "k": kv * dim, "v": kv * dim}
    weights = {f"{n}_proj.weight": randn(rows, hidden) for n, rows in shapes.items()}
    weights |= {f"{n}_proj.bias": randn(rows) for n, rows in shapes.items()}
    return weights | {"o_proj.weight": randn(hidden, heads * dim), "o_proj.bias": randn(hidden)}


def make_attention(heads: int, kv: int, parallel: ParallelContext | None = None) -> Attention:
    return Attention(
        hidden_size=32,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=8,
        layer_idx=0,
        attention=CausalAttentionBackend(),  # type: ignore[arg-type]
        qkv_bias=True,
        o_bias=True,
        parallel=parallel or ParallelContext(),
    )


def test_attention_is_causal_gqa_self_attention_with_rope() -> None:
    checkpoint, x = attention_checkpoint(32, 6, 3, 8), randn(10, 32)
    layer = make_attention(6, 3)
    load_checkpoint(layer, checkpoint.items(), FUSED)
    rotary = RotaryEmbedding(8, 64, 10000.0, {"rope_type": "default"})
    rope = rotary.prepare(torch.arange(10), torch.float32)
    reference = attention_reference(x, checkpoint, 6, 3)
    torch.testing.assert_close(layer(x, rotary, rope), reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("heads", "kv"), [(6, 3), (4, 1)], ids=["kv-groups", "replicated-kv"])
def test_attention_on_two_ranks_sums_to_the_whole_layer(heads: int, kv: int) -> None:
    checkpoint, x = attention_checkpoint(32, heads, kv, 8), randn(10, 32)
    rotary = RotaryEmbedding(8, 64, 10000.0, {"rope_type": "default"})
    rope = rotary.prepare(torch.arange(10), torch.float32)
    partials = []
    for parallel in two_ranks():
        layer = make_attention(heads, kv, parallel)
        load_checkpoint(layer, checkpoint.items(), FUSED)
        layer(x, rotary, rope)
        partials += parallel.partials
    reference = attention_reference(x, checkpoint, heads, kv)
    total = partials[0] + partials[1] + checkpoint["o_proj.bias"]
    torch.testing.assert_close(total, reference, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- MLP


def mlp_checkpoint(hidden: int, inter: int) -> dict[str, torch.Tensor]:
    return {
        "gate_proj.weight": randn(inter, hidden),
        "up_proj.weight": randn(inter, hidden),
        "down_proj.weight": randn(hidden, inter),
    }


def mlp_reference(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    gate, up = F.linear(x, w["gate_proj.weight"]), F.linear(x, w["up_proj.weight"])
    return F.linear(F.silu(gate) * up, w["down_proj.weight"])


def test_gated_mlp_is_down_of_silu_gate_times_up() -> None:
    checkpoint, x = mlp_checkpoint(16, 24), randn(5, 16)
    mlp = GatedMLP(16, 24, bias=False)
    load_checkpoint(mlp, checkpoint.items(), FUSED)
    torch.testing.assert_close(mlp(x), mlp_reference(x, checkpoint), atol=1e-6, rtol=1e-5)


def test_gated_mlp_on_two_ranks_sums_to_the_whole_layer() -> None:
    checkpoint, x = mlp_checkpoint(16, 25), randn(5, 16)  # 25 = 13 + 12
    partials = []
    for parallel in two_ranks():
        mlp = GatedMLP(16, 25, bias=False, parallel=parallel)
        load_checkpoint(mlp, checkpoint.items(), FUSED)
        mlp(x)
        partials += parallel.partials
    reference = mlp_reference(x, checkpoint)
    torch.testing.assert_close(partials[0] + partials[1], reference, atol=1e-6, rtol=1e-5)


def test_gated_mlp_refuses_an_activation_it_does_not_compute() -> None:
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        GatedMLP(16, 24, bias=False, hidden_act="gelu")


# --------------------------------------------------------------------------- embedding, head


def test_embedding_ranks_each_embed_their_vocabulary_slice_and_sum_to_the_lookup() -> None:
    table, ids = randn(11, 8), torch.tensor([0, 5, 6, 10, 3])
    whole = VocabParallelEmbedding(11, 8)
    load_checkpoint(whole, [("weight", table)], {})
    assert torch.equal(whole(ids), F.embedding(ids, table))
    partials = []
    for parallel in two_ranks():
        embedding = VocabParallelEmbedding(11, 8, parallel)
        load_checkpoint(embedding, [("weight", table)], {})
        assert torch.equal(embedding.weight, table[embedding.start : embedding.end])
        embedding(ids)
        partials += parallel.partials
    assert torch.equal(partials[0] + partials[1], F.embedding(ids, table))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_lm_head_ranks_give_their_slice_of_the_fp32_logits(tied: bool) -> None:
    matrix, hidden = randn(11, 8), randn(3, 8)
    slices = []
    for parallel in two_ranks():
        embedding = VocabParallelEmbedding(11, 8, parallel)
        head = embedding if tied else ParallelLMHead(11, 8, parallel)
        load_checkpoint(head, [("weight", matrix)], {})
        assert not tied or (head.start, head.end) == (embedding.start, embedding.end)
        slices.append(head.logits(hidden))
    logits = torch.cat(slices, -1)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ matrix.T)


# --------------------------------------------------------------------------- loading


class TinyBlock(torch.nn.Module):
    """What a model file is: layers wired together, with their checkpoint's fusions."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = make_attention(4, 2)
        self.mlp = GatedMLP(32, 24, bias=False)
        self.norm = RMSNorm(32, 1e-6)


def tiny_block_checkpoint() -> dict[str, torch.Tensor]:
    weights = {f"self_attn.{k}": v for k, v in attention_checkpoint(32, 4, 2, 8).items()}
    weights |= {f"mlp.{k}": v for k, v in mlp_checkpoint(32, 24).items()}
    return weights | {"norm.weight": randn(32)}


def test_load_checkpoint_fuses_q_k_v_and_gate_up_into_place() -> None:
    checkpoint, block = tiny_block_checkpoint(), TinyBlock()
    load_checkpoint(block, reversed(checkpoint.items()), FUSED)  # any order
    attn, mlp = block.self_attn, block.mlp
    qkv = [checkpoint[f"self_attn.{n}_proj.weight"] for n in "qkv"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat(qkv))
    gate_up = [checkpoint[f"mlp.{n}_proj.weight"] for n in ("gate", "up")]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat(gate_up))
    assert torch.equal(block.norm.weight, checkpoint["norm.weight"])


def test_load_checkpoint_names_unknown_missing_and_misshapen_tensors() -> None:
    checkpoint = tiny_block_checkpoint()
    with pytest.raises(ValueError, match=r"'self_attn\.q_norm\.weight' has no place in TinyBlock"):
        load_checkpoint(
            TinyBlock(), [*checkpoint.items(), ("self_attn.q_norm.weight", None)], FUSED
        )
    shaped = {**checkpoint, "mlp.up_proj.weight": randn(23, 32)}
    with pytest.raises(ValueError, match=r"'mlp.up_proj.weight' has shape \(23, 32\), expected"):
        load_checkpoint(TinyBlock(), shaped.items(), FUSED)
    del checkpoint["self_attn.k_proj.bias"], checkpoint["norm.weight"]
    with pytest.raises(ValueError, match=r"missing 2 weights.*'norm.weight'.*qkv_proj.bias\[k\]"):
        load_checkpoint(TinyBlock(), checkpoint.items(), FUSED)


def bf16_cpu_method(block: torch.nn.Module) -> None:
    """Give `block`'s linears the packed bf16 CPU method, as the loader does for any dtype
    where stack.linear_method names it."""
    chooser = LinearMethodChooser(
        dtype=torch.bfloat16, device=torch.device("cpu"), selected="cpu_bf16"
    )
    give_linear_methods(block, chooser)


def test_nothing_is_packed_in_fp32() -> None:
    block = TinyBlock()
    bf16_cpu_method(block)
    load_checkpoint(block, tiny_block_checkpoint().items(), FUSED)
    process_linear_weights(block)
    assert all(m.packed is None for m in block.modules() if isinstance(m, Linear))


@pytest.mark.skipif(
    not packed_linear.packing_supported(torch.bfloat16, torch.device("cpu")),
    reason="no bf16 packing on this CPU",
)
def test_a_packed_block_computes_what_it_did_and_refuses_a_second_load() -> None:
    checkpoint = {k: v.bfloat16() for k, v in tiny_block_checkpoint().items()}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        block = TinyBlock()
        bf16_cpu_method(block)
    finally:
        torch.set_default_dtype(previous)
    load_checkpoint(block, checkpoint.items(), FUSED)
    x = randn(3, 32).bfloat16()
    expected = block.mlp(x)
    process_linear_weights(block)
    assert all(m.packed is not None for m in block.modules() if isinstance(m, Linear))
    torch.testing.assert_close(block.mlp(x), expected, atol=0.02, rtol=0.02)
    with pytest.raises(RuntimeError, match="packed"):
        load_checkpoint(block, checkpoint.items(), FUSED)
