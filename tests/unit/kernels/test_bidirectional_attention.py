"""Bidirectional layers (an encoder's): the torch backend attends every query of a prompt
to every key of it, later ones included, in a batch of prompts of mixed lengths (SDPA
per prompt, or the prefill kernel's varlen call for all of them, bf16 or fp32), and writes
nothing to the KV cache, which no step of an encoder reads; a backend that cannot is
refused by name (flashinfer, whose prefill kernel is causal)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from plugserve.interfaces.model import AttentionBatch, AttentionSpec, LayerAttention
from plugserve.worker.model_runner import check_layer_attention
from plugserve_plugins.kernels import cpu_prefill_attention
from plugserve_plugins.kernels.flashinfer import FlashInferAttention
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention
from tests.kernel_support import require_kernel

BIDIRECTIONAL = LayerAttention(bidirectional=True)
HEADS, HEAD_DIM, BLOCK = 4, 16, 4


def spec(
    layers: int = 2, dtype: torch.dtype = torch.float32, head_dim: int = HEAD_DIM
) -> AttentionSpec:
    return AttentionSpec(
        num_layers=layers,
        num_heads=HEADS,
        num_kv_heads=HEADS,
        head_dim=head_dim,
        block_size=BLOCK,
        dtype=dtype,
        device=torch.device("cpu"),
        layers=(BIDIRECTIONAL,) * layers,
    )


def attend_prompts(
    backend: TorchPagedAttention, lengths: list[int], head_dim: int, dtype: torch.dtype
) -> None:
    """One step of whole prompts through `backend`, checked against dense attention per
    prompt, with the KV cache left as it was."""
    backend.allocate_kv_cache(16)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    blocks = np.zeros((len(lengths), 4), dtype=np.int32)
    slots = []
    next_block = 0
    for row, n in enumerate(lengths):
        count = -(-n // BLOCK)
        blocks[row, :count] = np.arange(next_block, next_block + count)
        slots += [blocks[row, i // BLOCK] * BLOCK + i % BLOCK for i in range(n)]
        next_block += count
    backend.prepare(
        AttentionBatch(starts, np.array(lengths, np.int32), blocks, np.array(slots, np.int64))
    )
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(sum(lengths), HEADS, head_dim, generator=generator).to(dtype) for _ in range(3)
    )
    cache_before = backend.kv_cache.clone()
    out = backend.forward(0, q, k, v)
    assert torch.equal(backend.kv_cache, cache_before)
    for row, n in enumerate(lengths):
        part = slice(int(starts[row]), int(starts[row]) + n)
        expected = F.scaled_dot_product_attention(
            *(t[part].float().transpose(0, 1) for t in (q, k, v)), is_causal=False
        ).transpose(0, 1)
        tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(out[part].float(), expected, **tolerance)


@pytest.mark.parametrize("kernel", ["auto", "sdpa"])
def test_each_prompt_attends_to_all_of_itself_and_nothing_is_cached(kernel: str) -> None:
    backend = TorchPagedAttention(spec=spec(), options=TorchPagedAttention.Options(kernel=kernel))
    # A one-token prompt too: a whole prompt, not a decode.
    attend_prompts(backend, [5, 1, 9], HEAD_DIM, torch.float32)


# Each dtype's varlen kernel: the instructions it needs, and why it is not loaded.
VARLEN_KERNELS = {
    torch.bfloat16: (
        cpu_prefill_attention.REQUIRED_CPU_FLAGS,
        cpu_prefill_attention.unavailable_reason,
    ),
    torch.float32: (
        cpu_prefill_attention.fp32_kernel().required_cpu_flags,
        cpu_prefill_attention.fp32_unavailable_reason,
    ),
}


def require_varlen_kernel(dtype: torch.dtype) -> None:
    """Skip only where the CPU lacks the kernel's instructions (or there is no compiler);
    a kernel that should load and does not fails the test."""
    flags, unavailable_reason = VARLEN_KERNELS[dtype]
    cpu_prefill_attention.load_varlen(dtype)
    require_kernel(f"the {dtype} varlen kernel", flags, unavailable_reason())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prefill_kernel", ["on", "off"])
def test_the_varlen_kernel_or_sdpa_attends_every_prompt_in_the_step(
    prefill_kernel: str, dtype: torch.dtype
) -> None:
    if prefill_kernel == "on":
        require_varlen_kernel(dtype)
    backend = TorchPagedAttention(
        spec=spec(dtype=dtype, head_dim=32),
        options=TorchPagedAttention.Options(prefill_kernel=prefill_kernel),
    )
    attend_prompts(backend, [5, 1, 9, 14], 32, dtype)
    assert (backend._plan.cu_seqlens is not None) == (prefill_kernel == "on")


@pytest.mark.parametrize("prefill_kernel", ["on", "off"])
def test_a_prompt_continuing_a_cached_prefix_is_refused(prefill_kernel: str) -> None:
    if prefill_kernel == "on":
        require_varlen_kernel(torch.bfloat16)
    backend = TorchPagedAttention(
        spec=spec(dtype=torch.bfloat16, head_dim=32),
        options=TorchPagedAttention.Options(prefill_kernel=prefill_kernel),
    )
    backend.allocate_kv_cache(8)
    batch = AttentionBatch(
        np.array([0, 3], np.int32),
        np.array([7], np.int32),  # 4 tokens before the 3 of this step
        np.array([[0, 1]], np.int32),
        np.array([4, 5, 6], np.int64),
    )
    with pytest.raises(ValueError, match="cannot be split into chunks"):
        backend.prepare(batch)


def test_the_causal_cpu_kernels_are_refused_by_name() -> None:
    options = TorchPagedAttention.Options(kernel="native")
    with pytest.raises(ValueError, match="attend bidirectionally"):
        TorchPagedAttention(spec=spec(), options=options)


def test_flashinfer_is_refused_naming_bidirectional() -> None:
    with pytest.raises(ValueError, match="does not support bidirectional"):
        check_layer_attention(FlashInferAttention, "flashinfer", (BIDIRECTIONAL,))


def test_a_bidirectional_layer_has_no_window() -> None:
    with pytest.raises(ValueError, match="no window"):
        LayerAttention(bidirectional=True, sliding_window=4)
