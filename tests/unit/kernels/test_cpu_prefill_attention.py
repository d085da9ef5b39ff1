"""cpu_prefill_attention against dense fp32 causal attention.

The kernel takes bf16 q/k/v and rounds the softmax probabilities to bf16 before the
value product (as SDPA's bf16 CPU kernel does) and its output to bf16; the reference
attends the same bf16 inputs in fp32. Tolerance: 2e-2 absolute plus 2e-2 relative on
outputs of unit-normal values (the measured error is under 1e-2).
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from plugserve.interfaces.model import FULL_ATTENTION, AttentionBatch, AttentionSpec, LayerAttention
from plugserve_plugins.kernels import cpu_prefill_attention
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention

pytestmark = pytest.mark.skipif(
    not cpu_prefill_attention.load(), reason="needs avx512_bf16 and a C++ compiler"
)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Dense fp32 softmax attention; causal: query i at position Tk - Tq + i (see the
    kernel), else every query sees every key (an encoder's prompt)."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if not causal:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    query_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    key_pos = torch.arange(k.shape[0])[None, :]
    seen = key_pos <= query_pos
    if window:
        seen &= key_pos > query_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def random_qkv(
    query_len: int, context_len: int, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(query_len * 1000 + context_len)
    keys = query_len + context_len

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return (
        rand(query_len, heads, head_dim),
        rand(keys, kv_heads, head_dim),
        rand(keys, kv_heads, head_dim),
    )


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("query_len", [1, 37, 64, 130, 300])
@pytest.mark.parametrize("context_len", [0, 5, 100])
def test_causal_with_and_without_context(query_len: int, context_len: int) -> None:
    q, k, v = random_qkv(query_len, context_len, heads=9, kv_heads=3, head_dim=64)
    out = cpu_prefill_attention.prefill_attention(q, k, v, 0.125)
    assert_matches(out, reference(q, k, v, 0.125))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 4, 64), (8, 2, 128), (5, 1, 64), (3, 3, 128), (12, 12, 32), (6, 2, 32)],
)
def test_head_groups_and_sizes(heads: int, kv_heads: int, head_dim: int) -> None:
    q, k, v = random_qkv(77, 20, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = cpu_prefill_attention.prefill_attention(q, k, v, scale)
    assert_matches(out, reference(q, k, v, scale))


@pytest.mark.parametrize("window", [1, 7, 64, 100, 1000])
@pytest.mark.parametrize("context_len", [0, 90])
def test_sliding_window(window: int, context_len: int) -> None:
    q, k, v = random_qkv(150, context_len, heads=6, kv_heads=2, head_dim=64)
    out = cpu_prefill_attention.prefill_attention(q, k, v, 0.125, window=window)
    assert_matches(out, reference(q, k, v, 0.125, window=window))


@pytest.mark.parametrize(("scale", "softcap"), [(0.5, 2.0), (0.125, 50.0), (1.0, None)])
def test_scale_and_soft_cap(scale: float, softcap: float | None) -> None:
    q, k, v = random_qkv(100, 30, heads=6, kv_heads=3, head_dim=64)
    out = cpu_prefill_attention.prefill_attention(q, k, v, scale, softcap=softcap)
    assert_matches(out, reference(q, k, v, scale, softcap=softcap))


def test_strided_token_rows_from_one_projection() -> None:
    """q, k, v split from one [T, (H + 2 KVH) * D] projection, as the models hand them."""
    heads, kv_heads, head_dim, tokens = 6, 2, 64, 90
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.view(tokens, heads, head_dim)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    out = cpu_prefill_attention.prefill_attention(q, k, v, 0.125)
    assert_matches(out, reference(q, k, v, 0.125))


def test_unsupported_head_dim_is_refused() -> None:
    q, k, v = random_qkv(10, 0, heads=2, kv_heads=1, head_dim=96)
    with pytest.raises(RuntimeError, match="head_dim 32, 64 or 128"):
        cpu_prefill_attention.prefill_attention(q, k, v, 0.125)


@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "head_dim", "softcap"),
    [
        ((9, 1, 64, 65, 127, 130, 2), 12, 12, 32, None),  # all-MiniLM-L6-v2's heads
        ((40, 3, 100), 8, 2, 64, None),
        ((70, 17), 4, 4, 128, 30.0),
        ((5,), 2, 2, 32, None),
    ],
)
def test_varlen_bidirectional_attends_each_prompt_to_all_of_itself(
    lengths: tuple[int, ...], heads: int, kv_heads: int, head_dim: int, softcap: float | None
) -> None:
    generator = torch.Generator().manual_seed(sum(lengths))
    total = sum(lengths)
    # Strided rows, as split from one projection.
    fused = torch.randn(total, (heads + 2 * kv_heads) * head_dim, generator=generator)
    q, k, v = fused.to(torch.bfloat16).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1
    )
    q = q.view(total, heads, head_dim)
    k, v = k.view(total, kv_heads, head_dim), v.view(total, kv_heads, head_dim)
    cu_seqlens = [0, *itertools.accumulate(lengths)]
    scale = head_dim**-0.5
    out = cpu_prefill_attention.varlen_bidirectional_attention(
        q, k, v, cu_seqlens, scale, softcap=softcap
    )
    for start, end in itertools.pairwise(cu_seqlens):
        assert_matches(
            out[start:end],
            reference(q[start:end], k[start:end], v[start:end], scale, softcap, causal=False),
        )


def test_varlen_cu_seqlens_must_cover_the_tokens() -> None:
    q, k, v = random_qkv(10, 0, heads=2, kv_heads=2, head_dim=32)
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0"):
        cpu_prefill_attention.varlen_bidirectional_attention(q, k, v, [0, 4, 8], 0.125)


# Through the backend: long prefill rows (fresh, and a chunk after cached context) in a
# bf16 paged cache, per layer options included, with the kernel on and with SDPA.
BLOCK = 16
LAYERS = (FULL_ATTENTION, LayerAttention(sliding_window=40, logit_softcap=30.0, scale=0.1))


@pytest.mark.parametrize("prefill_kernel", ["on", "off"])
def test_backend_prefill_rows_match_dense_attention(prefill_kernel: str) -> None:
    heads, kv_heads, head_dim = 9, 3, 64
    spec = AttentionSpec(
        num_layers=len(LAYERS),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=BLOCK,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        layers=LAYERS,
    )
    options = TorchPagedAttention.Options(prefill_kernel=prefill_kernel)
    backend = TorchPagedAttention(spec=spec, options=options)
    backend.allocate_kv_cache(32)
    g = torch.Generator().manual_seed(0)
    lengths = {"fresh": 100, "chunked": 110}
    qkv = {
        name: [
            torch.randn(n, h, head_dim, generator=g).to(torch.bfloat16)
            for h in (heads, kv_heads, kv_heads)
        ]
        for name, n in lengths.items()
    }
    blocks = {"fresh": list(range(0, 7)), "chunked": list(range(31, 23, -1))}

    def step(rows: list[tuple[str, int, int]]) -> None:
        table = np.zeros((len(rows), 8), dtype=np.int32)
        slots = []
        for i, (name, start, end) in enumerate(rows):
            table[i, : len(blocks[name])] = blocks[name]
            pos = np.arange(start, end)
            slots.append(np.asarray(blocks[name])[pos // BLOCK] * BLOCK + pos % BLOCK)
        backend.prepare(
            AttentionBatch(
                query_start_loc=np.cumsum([0] + [e - s for _, s, e in rows], dtype=np.int32),
                seq_lens=np.array([e for _, _, e in rows], dtype=np.int32),
                block_table=table,
                slot_mapping=np.concatenate(slots),
            )
        )
        for index, layer in enumerate(LAYERS):
            q, k, v = (torch.cat([qkv[n][part][s:e] for n, s, e in rows]) for part in range(3))
            out = backend.forward(index, q, k, v)
            offset = 0
            for name, start, end in rows:
                full_q, full_k, full_v = (t[:end] for t in qkv[name])
                expected = reference(
                    full_q[start:],
                    full_k,
                    full_v,
                    layer.softmax_scale(head_dim),
                    layer.logit_softcap,
                    layer.sliding_window,
                )
                assert_matches(out[offset : offset + end - start], expected)
                offset += end - start

    step([("chunked", 0, 30), ("fresh", 0, 100)])
    step([("chunked", 30, 110)])  # 80 tokens after 30 cached: the context is read back


def test_prefill_kernel_on_where_it_cannot_run_is_refused() -> None:
    spec = AttentionSpec(
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        block_size=BLOCK,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    backend = TorchPagedAttention(
        spec=spec, options=TorchPagedAttention.Options(prefill_kernel="on")
    )
    with pytest.raises(ValueError, match="prefill_kernel 'on' needs"):
        backend.allocate_kv_cache(4)


@pytest.mark.parametrize("kernel", ["native", "sdpa"])
def test_prefill_kernel_on_beside_a_kernel_that_never_routes_long_rows_is_refused(
    kernel: str,
) -> None:
    spec = AttentionSpec(
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        block_size=BLOCK,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    options = TorchPagedAttention.Options(kernel=kernel, prefill_kernel="on")
    with pytest.raises(ValueError, match="prefill_kernel 'on' needs kernel 'auto'"):
        TorchPagedAttention(spec=spec, options=options)


@pytest.mark.parametrize(
    "choose",
    [
        # A decoder's long prefill rows (GQA heads of 64).
        lambda: cpu_prefill_attention.faster_than_sdpa(8, 2, 64, tokens=128),
        # An encoder's steps (all-MiniLM-L6-v2's heads).
        lambda: cpu_prefill_attention.varlen_faster_than_sdpa(12, 12, 32),
    ],
    ids=["causal", "varlen"],
)
def test_the_timed_choice_is_the_faster_of_the_two_timings_it_logs(
    choose, caplog: pytest.LogCaptureFixture
) -> None:
    """Under prefill_kernel auto the backend takes what these return: whichever way the
    timing goes on this machine, the answer is the one its logged timings give."""
    with caplog.at_level("INFO", logger=cpu_prefill_attention.__name__):
        faster = choose()
    [line] = [r.getMessage() for r in caplog.records if "SDPA" in r.getMessage()]
    found = re.search(r"kernel ([\d.]+) ms, SDPA ([\d.]+) ms; using (the kernel|SDPA)", line)
    assert found, line
    kernel_ms, sdpa_ms, using = float(found[1]), float(found[2]), found[3]
    assert faster is (using == "the kernel")
    assert faster is (kernel_ms < sdpa_ms) or kernel_ms == sdpa_ms
