"""Tensor-parallel shard ranges, and the sharded Llama on 2 gloo ranks against the
unsharded one (tiny random models covering uneven heads/vocab/intermediate splits,
replicated KV heads, biases, tied and untied heads)."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from plugserve.interfaces.model import AttentionBatch, AttentionSpec
from plugserve.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from plugserve.worker.parallel import (
    HeadShard,
    ParallelContext,
    init_parallel,
    shard_heads,
    split_evenly,
)
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention

# --------------------------------------------------------------------------- shard ranges


def test_split_evenly_gives_the_remainder_to_the_first_parts() -> None:
    assert split_evenly(10, 2) == [(0, 5), (5, 10)]
    assert split_evenly(49153, 2) == [(0, 24577), (24577, 49153)]
    assert split_evenly(97, 3) == [(0, 33), (33, 65), (65, 97)]
    assert split_evenly(2, 3) == [(0, 1), (1, 2), (2, 2)]
    with pytest.raises(ValueError):
        split_evenly(4, 0)


def test_heads_shard_by_kv_groups_evenly() -> None:
    assert shard_heads(8, 4, 2) == [HeadShard(0, 4, 0, 2), HeadShard(4, 8, 2, 4)]
    assert shard_heads(8, 8, 1) == [HeadShard(0, 8, 0, 8)]


def test_smollm2_heads_shard_unevenly_on_two_ranks() -> None:
    # 9 query heads in 3 groups of 3: rank 0 takes 2 KV heads and their 6 query heads.
    assert shard_heads(9, 3, 2) == [HeadShard(0, 6, 0, 2), HeadShard(6, 9, 2, 3)]


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    assert shard_heads(8, 2, 4) == [
        HeadShard(0, 2, 0, 1),
        HeadShard(2, 4, 0, 1),
        HeadShard(4, 6, 1, 2),
        HeadShard(6, 8, 1, 2),
    ]
    # 3 KV heads over 4 ranks: KV head 0 is on two ranks that split its 3 query heads.
    assert shard_heads(9, 3, 4) == [
        HeadShard(0, 2, 0, 1),
        HeadShard(2, 3, 0, 1),
        HeadShard(3, 6, 1, 2),
        HeadShard(6, 9, 2, 3),
    ]
    assert shard_heads(4, 1, 3) == [
        HeadShard(0, 2, 0, 1),
        HeadShard(2, 3, 0, 1),
        HeadShard(3, 4, 0, 1),
    ]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world"),
    [(9, 3, 2), (9, 3, 3), (9, 3, 4), (32, 8, 3), (32, 8, 16), (12, 12, 5), (14, 2, 7)],
)
def test_every_query_head_is_on_exactly_one_rank_with_its_kv_head(
    heads: int, kv_heads: int, world: int
) -> None:
    group = heads // kv_heads
    shards = shard_heads(heads, kv_heads, world)
    assert len(shards) == world
    owned = [q for s in shards for q in range(s.q_start, s.q_end)]
    assert owned == list(range(heads))
    for s in shards:
        assert s.num_heads >= 1
        assert s.num_heads % s.num_kv_heads == 0  # a proper local GQA layout
        assert [q // group for q in range(s.q_start, s.q_end)] == [
            kv for kv in range(s.kv_start, s.kv_end) for _ in range(s.num_heads // s.num_kv_heads)
        ]


def test_more_ranks_than_query_heads_in_a_group_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot shard"):
        shard_heads(4, 4, 8)


def test_parallel_context_shards() -> None:
    ctx = ParallelContext(rank=1, world_size=2)
    assert not ctx.is_driver
    assert ctx.shard(1536) == (768, 1536)
    assert ctx.head_shard(9, 3) == HeadShard(6, 9, 2, 3)


# --------------------------------------------------------------------------- 2 gloo ranks

BLOCK_SIZE = 4
CONFIGS = {
    # Uneven everything: 2+1 KV heads, vocab 131 = 66 + 65, intermediate 97 = 49 + 48;
    # biases on q/k/v/o and the MLP (row-parallel biases are added once), untied head.
    "uneven-bias-untied": dict(
        vocab_size=131,
        hidden_size=48,
        intermediate_size=97,
        num_attention_heads=6,
        num_key_value_heads=3,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    ),
    # One KV head on two ranks (replicated), Qwen2's q/k/v bias, tied embeddings.
    "replicated-kv-tied": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=1,
        model_type="qwen2",
        tie_word_embeddings=True,
    ),
}
COMMON = dict(
    num_hidden_layers=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    hidden_act="silu",
)
PROMPTS = [[5, 17, 99, 3, 64, 120, 7], [1, 2], [42, 8, 77, 101, 13]]


def _config(name: str) -> SimpleNamespace:
    return SimpleNamespace(**COMMON, **CONFIGS[name])


def _checkpoint(name: str) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names."""
    c = _config(name)
    head_dim = c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    h, inter = c.hidden_size, c.intermediate_size
    qkv_bias = getattr(c, "attention_bias", False) or getattr(c, "model_type", "") == "qwen2"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
        }
        if qkv_bias:
            layer |= {f"self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv))}
        if getattr(c, "attention_bias", False):
            layer["self_attn.o_proj.bias"] = (h,)
        if getattr(c, "mlp_bias", False):
            layer |= {"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,)}
            layer["mlp.down_proj.bias"] = (h,)
        shapes |= {p + k: v for k, v in layer.items()}
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen) * 0.2 for k, s in shapes.items()}


@torch.inference_mode()
def _logits(name: str, weights: dict[str, torch.Tensor], parallel: ParallelContext | None) -> Any:
    """Prefill the prompts as one varlen batch, then decode one greedy token each:
    fp32 logits of both steps [2 * len(PROMPTS), vocab] (None off the driver rank)."""
    config = _config(name)
    ctx = parallel or ParallelContext()
    heads = ctx.head_shard(config.num_attention_heads, config.num_key_value_heads)
    backend = TorchPagedAttention(
        spec=AttentionSpec(
            num_layers=config.num_hidden_layers,
            num_heads=heads.num_heads,
            num_kv_heads=heads.num_kv_heads,
            head_dim=config.hidden_size // config.num_attention_heads,
            block_size=BLOCK_SIZE,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
    )
    backend.allocate_kv_cache(32)
    model_class = (
        Qwen2ForCausalLM if getattr(config, "model_type", "") == "qwen2" else LlamaForCausalLM
    )
    model = model_class(hf_config=config, attention=backend, parallel=parallel).eval()
    model.load_weights(weights.items())
    blocks = [list(range(i * 8, i * 8 + 8)) for i in range(len(PROMPTS))]
    table = np.asarray(blocks, dtype=np.int32)

    def step(tokens: list[list[int]], starts: list[int]) -> Any:
        positions = [np.arange(s, s + len(t)) for s, t in zip(starts, tokens, strict=True)]
        slots = [
            table[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for i, p in enumerate(positions)
        ]
        cu = np.cumsum([0] + [len(t) for t in tokens], dtype=np.int32)
        backend.prepare(
            AttentionBatch(
                query_start_loc=cu,
                seq_lens=np.asarray([p[-1] + 1 for p in positions], dtype=np.int32),
                block_table=table,
                slot_mapping=np.concatenate(slots).astype(np.int64),
            )
        )
        ids = torch.tensor([t for seq in tokens for t in seq])
        hidden = model(ids, torch.from_numpy(np.concatenate(positions)))
        return model.compute_logits(hidden[torch.from_numpy(cu[1:] - 1).long()])

    first = step(PROMPTS, [0] * len(PROMPTS))
    # Every rank must feed the same next tokens: the driver's argmax, broadcast.
    next_ids = (
        first.argmax(-1) if first is not None else torch.empty(len(PROMPTS), dtype=torch.long)
    )
    ctx.broadcast(next_ids)
    second = step([[int(t)] for t in next_ids], [len(p) for p in PROMPTS])
    return None if first is None else torch.cat([first, second])


def _rank_main(rank: int, world: int, port: int, weights_path: str, out_path: str) -> None:
    parallel = init_parallel(
        rank=rank,
        world_size=world,
        local_rank=rank,
        master_addr="127.0.0.1",
        master_port=port,
        device=torch.device("cpu"),
        timeout_s=30,
    )
    torch.set_num_threads(1)
    checkpoints = torch.load(weights_path)
    results = {name: _logits(name, checkpoints[name], parallel) for name in CONFIGS}
    if rank == 0:
        torch.save(results, out_path)
    # Leave together and tear gloo down explicitly: a rank exiting with its group still
    # up can abort in gloo's threads ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_two_gloo_ranks_give_the_unsharded_logits(tmp_path: Path) -> None:
    checkpoints = {name: _checkpoint(name) for name in CONFIGS}
    weights_path, out_path = tmp_path / "weights.pt", tmp_path / "logits.pt"
    torch.save(checkpoints, weights_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(rank, 2, port, str(weights_path), str(out_path)))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    sharded = torch.load(out_path)
    for name in CONFIGS:
        reference = _logits(name, checkpoints[name], None)
        assert (
            sharded[name].shape
            == reference.shape
            == (2 * len(PROMPTS), CONFIGS[name]["vocab_size"])
        )
        torch.testing.assert_close(sharded[name], reference, atol=1e-5, rtol=1e-5, msg=name)
