"""Rotary position embeddings (neox/HF rotate-half) and the RoPE scaling variants."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plugserve.worker.layers.direct_call import direct_call


def rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict with "rope_type") from a transformers 4 config
    (rope_theta + rope_scaling) or a transformers 5 one (rope_parameters)."""
    params = dict(
        getattr(hf_config, "rope_parameters", None)
        or getattr(hf_config, "rope_scaling", None)
        or {}
    )
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type", params.pop("type", "default"))
    return float(theta), params


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int | None = None
) -> torch.Tensor:
    """Inverse frequencies for the "default", "linear", "llama3" and "longrope" RoPE types,
    computed exactly as transformers does so logits match it bit for bit in fp32.
    `head_dim`: the rotated dimensions (all of a head's, or its first part with a partial
    rotary factor). `max_positions`: the table's length, which picks longrope's factors
    (longrope_uses_long_factors)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    rope_type = scaling["rope_type"]
    if rope_type == "longrope":
        use_long = max_positions is not None and longrope_uses_long_factors(scaling, max_positions)
        factors = scaling["long_factor" if use_long else "short_factor"]
        if len(factors) != head_dim // 2:
            raise ValueError(
                f"longrope needs {head_dim // 2} factors (one per rotated pair), got {len(factors)}"
            )
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, longrope)"
    )


def longrope_uses_long_factors(scaling: dict[str, Any], max_positions: int) -> bool:
    """Whether a longrope model rotates by its long factors: here, for every sequence,
    when the table reaches past original_max_position_embeddings.

    transformers decides per forward pass instead: long factors when the pass's largest
    position + 1 exceeds original_max_position_embeddings, and Phi-3's generate drops its
    KV cache and recomputes the whole sequence when it grows past that length. A server's
    KV cache keeps keys rotated once, for the sequence's life, so plugserve (as vLLM) picks
    one table per model: the two agree on sequences longer than
    original_max_position_embeddings, and on every sequence where the model's
    max_position_embeddings does not exceed it."""
    return max_positions > int(scaling["original_max_position_embeddings"])


def rope_attention_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """The factor transformers multiplies cos and sin by: longrope's attention factor
    (given, or sqrt(1 + ln(factor) / ln(original length)) with factor the extension
    max_positions / original_max_position_embeddings where not given); 1 otherwise."""
    if scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


@dataclass
class RopeStep:
    """One step's rotary inputs, gathered once for all layers."""

    positions: torch.Tensor  # int64 [T]
    # [T, 1, D] each in the model's dtype, for the ATen path; None with the fused op.
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


@direct_call
class RotaryEmbedding(nn.Module):
    """Neox/HF (rotate-half) RoPE with cos/sin precomputed for every position.

    ATen path: rotate_half(x) * sin equals roll(x, D/2) * sin with the first half of sin
    negated, exactly (only signs move), which saves the split, negation and concatenation;
    q and k rotate together. After `use_fused_op` (a model pass running layers over the
    fused CPU ops) the layers rotate through cpu_ops with `cos_sin`, and `prepare` gathers
    nothing unless some layer still rotates on the ATen path.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any],
        rotary_dim: int | None = None,
    ):
        """`rotary_dim`: rotate only each head's first rotary_dim dimensions and pass the
        rest through (a partial rotary factor: Phi-4-mini's 0.75); all by default."""
        super().__init__()
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, {head_dim}]")
        inv_freq = rope_inv_freq(self.rotary_dim, theta, scaling, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # longrope scales cos and sin (in fp32, before the cast, as transformers).
        attention_factor = rope_attention_factor(scaling, max_positions)
        # fp32 whatever the model dtype: cast per step, as HF does, to keep precision.
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos().float() * attention_factor, persistent=False)
        sin = emb.sin().float() * attention_factor
        sin[:, : self.rotary_dim // 2] *= -1
        self.register_buffer("sin", sin, persistent=False)
        self.head_dim = head_dim
        self.half = self.rotary_dim // 2
        self.cos_sin: torch.Tensor | None = None  # the fused op's table, once switched on
        self.gathers = True  # whether prepare gathers the ATen path's cos and sin

    @property
    def partial(self) -> bool:
        """Whether each head keeps dimensions unrotated (a partial rotary factor)."""
        return self.rotary_dim != self.head_dim

    def use_fused_op(self, *, gather: bool = False) -> None:
        """Build cpu_ops' table: each position's rotary_dim/2 cosines, then its rotary_dim/2
        unsigned sines (the second half of `sin`); cpu_ops rotates the first rotary_dim
        dimensions of each head by it. `gather`: some layers still rotate on the ATen path,
        so `prepare` keeps gathering their cos and sin."""
        self.cos_sin = torch.cat((self.cos[:, : self.half], self.sin[:, self.half :]), dim=-1)
        self.gathers = gather

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        if not self.gathers:
            return RopeStep(positions)
        return RopeStep(
            positions,
            self.cos[positions].to(dtype)[:, None, :],
            self.sin[positions].to(dtype)[:, None, :],
        )

    def forward(self, qkv: torch.Tensor, step: RopeStep, num_heads: int) -> torch.Tensor:
        """The first num_heads heads of each row of qkv [T, >= heads * D], rotated by each
        token's position → [T, num_heads, D]."""
        assert step.cos is not None and step.sin is not None, "prepared for the fused op"
        x = qkv[:, : num_heads * self.head_dim].view(-1, num_heads, self.head_dim)
        if not self.partial:
            return x * step.cos + torch.roll(x, self.half, dims=-1) * step.sin
        rotated, passed = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        rotated = rotated * step.cos + torch.roll(rotated, self.half, dims=-1) * step.sin
        return torch.cat((rotated, passed), dim=-1)
