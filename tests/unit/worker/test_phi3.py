"""Phi3ForCausalLM's own parts against transformers: its fused checkpoint tensors split
into shards (each tensor-parallel rank taking its heads' rows of q, of k and of v, and its
slice of gate and of up), longrope's cos/sin tables and the partial rotary factor. The
whole model against transformers: tests/correctness/architecture_cases/phi3.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from plugserve.model_files import CheckpointError
from plugserve.worker.model_loader import iter_weights
from plugserve.worker.models.phi3 import Phi3ForCausalLM
from plugserve.worker.parallel import ParallelContext
from tests.model_support import make_backend

HEAD_DIM = 8
# Uneven on two ranks everywhere: KV heads 2 + 1 (query heads 4 + 2), intermediate
# 49 + 48, vocabulary 66 + 65.
SHARDED = dict(
    vocab_size=131,
    hidden_size=48,
    intermediate_size=97,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def longrope(original: int, rotary_pairs: int, **extra: Any) -> dict[str, Any]:
    """longrope parameters with short and long factors that differ pair by pair."""
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(rotary_pairs)],
        "long_factor": [1.0 + 2.0 * i for i in range(rotary_pairs)],
        "original_max_position_embeddings": original,
        **extra,
    }


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Phi3Config, Path]:
    """A random Phi-3 saved by transformers: qkv_proj and gate_up_proj stored fused."""
    config = Phi3Config(**SHARDED)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    folder = tmp_path_factory.mktemp("phi3")
    model.save_pretrained(str(folder))
    return config, folder


def test_the_checkpoint_stores_q_k_v_and_gate_up_fused(
    sharded_checkpoint: tuple[Phi3Config, Path],
) -> None:
    _, folder = sharded_checkpoint
    names = {name for name, _ in iter_weights(folder)}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any("q_proj" in name or "gate_proj" in name for name in names)


def test_each_of_two_ranks_takes_its_heads_of_q_k_v_and_its_slice_of_gate_and_up(
    sharded_checkpoint: tuple[Phi3Config, Path],
) -> None:
    config, folder = sharded_checkpoint
    checkpoint = dict(iter_weights(folder))
    qkv = checkpoint["model.layers.1.self_attn.qkv_proj.weight"]
    q, k, v = qkv.split([6 * HEAD_DIM, 3 * HEAD_DIM, 3 * HEAD_DIM])
    gate, up = checkpoint["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
    o = checkpoint["model.layers.1.self_attn.o_proj.weight"]
    down = checkpoint["model.layers.1.mlp.down_proj.weight"]

    ranks_q = []
    for rank in range(2):
        parallel = ParallelContext(rank=rank, world_size=2)
        model = Phi3ForCausalLM(
            hf_config=config, attention=make_backend(config, num_blocks=1), parallel=parallel
        )
        model.load_weights(iter_weights(folder))
        layer = model.model.layers[1]
        heads = parallel.head_shard(6, 3)
        qs, kvs = (
            slice(heads.q_start * HEAD_DIM, heads.q_end * HEAD_DIM),
            slice(heads.kv_start * HEAD_DIM, heads.kv_end * HEAD_DIM),
        )
        inter = slice(*parallel.shard(97))
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat((q[qs], k[kvs], v[kvs])))
        assert torch.equal(layer.self_attn.o_proj.weight, o[:, qs])
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat((gate[inter], up[inter])))
        assert torch.equal(layer.mlp.down_proj.weight, down[:, inter])
        ranks_q.append(layer.self_attn.qkv_proj.weight[: layer.self_attn.q_size])
    # Rank 0 holds KV heads 0-1 with query heads 0-3, rank 1 KV head 2 with 4-5.
    assert [len(rows) // HEAD_DIM for rows in ranks_q] == [4, 2]
    assert torch.equal(torch.cat(ranks_q), q)


def test_a_fused_tensor_of_another_height_fails_in_one_line_naming_it(
    sharded_checkpoint: tuple[Phi3Config, Path],
) -> None:
    config, folder = sharded_checkpoint
    model = Phi3ForCausalLM(hf_config=config, attention=make_backend(config, num_blocks=1))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    weights = ((n, t[:-HEAD_DIM] if n == name else t) for n, t in iter_weights(folder))
    with pytest.raises(CheckpointError, match=r"qkv_proj.weight' has 88 rows, expected 96 \(q 48"):
        model.load_weights(weights)


@pytest.mark.parametrize(
    ("original", "factors"),
    [(16, "long_factor"), (64, "short_factor")],
    ids=["past-the-original-length", "within-it"],
)
def test_longrope_tables_are_transformers_cos_and_sin(original: int, factors: str) -> None:
    """With max_position_embeddings (64) past original_max_position_embeddings the long
    factors rotate, as transformers over a sequence that long; within it the short ones.
    The attention factor scales both (from `factor` where given)."""
    config = Phi3Config(
        **SHARDED,
        original_max_position_embeddings=original,
        rope_parameters=longrope(original, HEAD_DIM // 2, factor=4.0),
    )
    model = Phi3ForCausalLM(hf_config=config, attention=make_backend(config, num_blocks=1))
    hf_rotary = Phi3RotaryEmbedding(config)
    positions = torch.arange(64)[None]
    cos, sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions)
    ours = model.rotary
    half = HEAD_DIM // 2
    torch.testing.assert_close(ours.cos, cos[0], rtol=0, atol=0)
    torch.testing.assert_close(ours.sin[:, half:], sin[0, :, half:], rtol=0, atol=0)
    torch.testing.assert_close(ours.sin[:, :half], -sin[0, :, :half], rtol=0, atol=0)
    # The premise: transformers rotated this sequence by these factors, scaled by
    # sqrt(1 + ln 4 / ln original) > 1.
    exponents = torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM
    chosen = torch.tensor(config.rope_parameters[factors])
    torch.testing.assert_close(hf_rotary.inv_freq, 1.0 / (chosen * 10000.0**exponents))
    assert hf_rotary.attention_scaling > 1.0


def test_partial_rotary_rotates_the_first_part_of_each_head_as_transformers() -> None:
    """partial_rotary_factor 0.75 (Phi-4-mini's): 6 of each head's 8 dimensions rotate."""
    config = Phi3Config(
        **SHARDED,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 500.0,
            "partial_rotary_factor": 0.75,
        },
    )
    model = Phi3ForCausalLM(hf_config=config, attention=make_backend(config, num_blocks=1))
    assert model.rotary.rotary_dim == 6 and model.rotary.partial
    torch.manual_seed(0)
    tokens, heads = 5, 6 + 3
    qk = torch.randn(tokens, heads * HEAD_DIM)
    positions = torch.tensor([0, 3, 7, 20, 63])
    ours = model.rotary(qk, model.rotary.prepare(positions, torch.float32), heads)

    cos, sin = Phi3RotaryEmbedding(config)(qk, positions[None])
    q, k = qk.view(1, tokens, heads, HEAD_DIM).transpose(1, 2).split([6, 3], dim=1)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    expected = torch.cat((q_hf, k_hf), dim=1).transpose(1, 2)[0]
    torch.testing.assert_close(ours, expected)
    assert torch.equal(ours[..., 6:], qk.view(tokens, heads, HEAD_DIM)[..., 6:])
