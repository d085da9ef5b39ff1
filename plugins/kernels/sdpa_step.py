"""The SDPA path of torch_paged's attention: the per-step plan (which blocks each row
reads, its masks per sliding window) built once for all layers, and the attention call
itself, soft-capping included (SDPA cannot cap scores)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from plugserve.interfaces.model import AttentionSpec

WHOLE_PROMPTS_ONLY = (
    "a bidirectional layer attends over its whole prompt at once: a prompt cannot be split "
    "into chunks or continue a cached prefix"
)

# A layer's sliding window (None: the whole context); the plans hold a mask per window.
Window = int | None


@dataclass(frozen=True)
class PrefillRow:
    """One multi-token row: its queries sit at positions context_len .. seq_len - 1."""

    start: int  # first token of the row in the flat batch
    end: int
    seq_len: int
    # With context: the blocks holding all seq_len tokens. Without: None, the chunk
    # attends to its own k/v.
    block_ids: torch.Tensor | None
    # Per window, the [query_len, keys] bool mask (True: attended): causal, shifted by
    # context_len, within the window. None: plain causal over the chunk's own keys
    # (no context, no window), which lets SDPA pick a fused kernel.
    masks: dict[Window, torch.Tensor | None]


@dataclass(frozen=True)
class DecodeRows:
    """All single-token rows, attended in one padded call."""

    token_index: torch.Tensor | None  # [B] flat token of each row; None: all tokens, in order
    block_table: torch.Tensor  # [B, max_blocks] int64, padded with valid ids
    # Per window, [B, 1, 1, max_blocks * block_size]: 0 for the tokens a row attends to
    # (its context, or its window's last tokens of it), -inf elsewhere.
    biases: dict[Window, torch.Tensor]


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


def used_blocks(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """The table cut to the longest row's blocks, as int64; entries past a row's last
    block may be stale, so they are set to block 0 (valid, and never read)."""
    num_blocks = int(-(-seq_lens.max() // block_size))
    blocks = np.ascontiguousarray(block_table[:, :num_blocks], dtype=np.int64)
    blocks[np.arange(num_blocks)[None, :] >= (-(-seq_lens // block_size))[:, None]] = 0
    return blocks


def plan_decodes(
    token_index: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    all_rows: bool,
    spec: AttentionSpec,
    windows: tuple[Window, ...],
) -> DecodeRows:
    """All single-token rows' plan: the blocks each reads and, per window, its bias."""
    blocks = used_blocks(block_table, seq_lens, spec.block_size)
    positions = np.arange(blocks.shape[1] * spec.block_size)[None, :]
    ends = seq_lens[:, None]

    def bias(window: Window) -> torch.Tensor:
        seen = positions < ends
        if window is not None:
            seen &= positions >= ends - window
        mask = np.where(seen, 0.0, -np.inf).astype(np.float32)
        return to_device(mask, spec.device).to(spec.dtype)[:, None, None, :]

    return DecodeRows(
        token_index=None if all_rows else to_device(token_index, spec.device),
        block_table=to_device(blocks, spec.device),
        biases={window: bias(window) for window in windows},
    )


def plan_prefill(
    start: int,
    end: int,
    seq_len: int,
    block_row: np.ndarray,
    spec: AttentionSpec,
    windows: tuple[Window, ...],
    bidirectional: bool,
) -> PrefillRow:
    """One multi-token row's plan: the blocks of its context, if any, and its masks."""
    device = torch.device(spec.device)
    context_len = seq_len - (end - start)
    if context_len and bidirectional:
        raise ValueError(WHOLE_PROMPTS_ONLY)
    block_ids = None
    if context_len:
        num_blocks = -(-seq_len // spec.block_size)
        block_ids = to_device(block_row[:num_blocks].astype(np.int64), spec.device)
    elif all(window is None for window in windows):
        # A fresh prompt's plain causal (or, bidirectional, unmasked) attention: no mask,
        # so no positions to build (an encoder's step plans one such row per prompt).
        return PrefillRow(start, end, seq_len, None, dict.fromkeys(windows))
    query_pos = torch.arange(context_len, seq_len, device=device)[:, None]
    # Keys: the whole context with context, else the chunk's own (positions 0..).
    key_pos = torch.arange(seq_len if context_len else end - start, device=device)

    def mask(window: Window) -> torch.Tensor | None:
        if context_len == 0 and window is None:
            return None
        seen = key_pos[None, :] <= query_pos
        if window is not None:
            seen &= key_pos[None, :] > query_pos - window
        return seen

    return PrefillRow(start, end, seq_len, block_ids, {w: mask(w) for w in windows})


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    causal: bool = True,
) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, KVH, Lk, D] (H a multiple of KVH) → [B, H, Lq, D].
    mask: bool (True: attended) or additive, broadcast to [B, H, Lq, Lk]; None: plain
    causal with Lq == Lk (a fresh prefill), which lets SDPA pick a fused kernel, or
    with `causal` False, no mask at all (a bidirectional layer's whole prompt)."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and causal,
            scale=scale,
            enable_gqa=gqa,
        )
    # Soft-capped: the scores explicitly, in transformers' order (scale, cap, mask,
    # softmax in fp32).
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        mask = mask.tril() if causal else mask
    bool_mask = mask.dtype == torch.bool
    scores = scores.masked_fill(~mask, float("-inf")) if bool_mask else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
