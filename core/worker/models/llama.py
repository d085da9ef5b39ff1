"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style GQA, Qwen2's QKV bias).

Written against the AttentionBackend interface: the model works on one flat varlen batch
of tokens (no batch dimension, no padding) and hands each layer's q/k/v to the backend,
which owns the paged KV cache. Q/K/V and gate/up are fused into one matmul each; the
Hugging Face checkpoint's separate tensors are copied into their slices at load time.

Tensor parallelism (a ParallelContext with world_size > 1): QKV and gate-up are
column-parallel (each rank holds its heads' / its intermediate slice's rows), o_proj and
down_proj row-parallel (the matching input columns, then an all-reduce), the embedding
and the LM head vocab-parallel. load_weights slices each checkpoint tensor for the rank.
Without one, no collective runs and the layers are plain matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from plugserve.interfaces import AttentionBackend
from plugserve.worker import cpu_linear, cpu_ops
from plugserve.worker.models.llama_cpu import FusedCpuDecoder, FusedCpuDecoderLayer
from plugserve.worker.parallel import NO_PARALLEL, ParallelContext

# Checkpoint tensors that are derived state in HF's own model, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies for the "default", "linear" and "llama3" RoPE types, computed
    exactly as transformers does so logits match it bit for bit in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling["rope_type"]
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
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


M = TypeVar("M", bound=type[nn.Module])


def direct_call(cls: M) -> M:
    """Call the module's forward without nn.Module.__call__'s hook dispatch.

    A batch-1 decode step calls ~300 of these modules, and the dispatch was ~5 % of its
    time. Modules marked so run no forward hooks or pre-hooks (plugserve registers none).
    """
    cls.__call__ = cls.forward  # type: ignore[method-assign]
    return cls


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
    q and k rotate together. After `use_fused_op` (bf16 on CPU) the layers rotate through
    cpu_ops in FusedCpuDecoderLayer, with `cos_sin`; `prepare` then gathers nothing.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # fp32 whatever the model dtype: cast per step, as HF does, to keep precision.
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        sin = emb.sin().float()
        sin[:, : head_dim // 2] *= -1
        self.register_buffer("sin", sin, persistent=False)
        self.head_dim = head_dim
        self.half = head_dim // 2
        self.cos_sin: torch.Tensor | None = None  # the fused op's table, once switched on

    def use_fused_op(self) -> None:
        """Build cpu_ops' table: each position's D/2 cosines, then its D/2 unsigned sines
        (the second half of `sin`)."""
        self.cos_sin = torch.cat((self.cos[:, : self.half], self.sin[:, self.half :]), dim=-1)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        if self.cos_sin is not None:
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
        return x * step.cos + torch.roll(x, self.half, dims=-1) * step.sin


@direct_call
class RMSNorm(nn.Module):
    """RMSNorm; with `fused` (the model's final norm, bf16 on CPU) one cpu_ops call, which
    also takes the residual add (`add_and_norm`)."""

    fused = False

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). The fused op reuses x's and residual's
        memory for the results: both must be this step's own tensors."""
        if self.fused:
            return cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # HF's LlamaRMSNorm exactly: F.rms_norm without a weight is bit-identical to
            # its formula, and the weight multiplies afterwards.
            return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)
        # Half precision: one fused op (fp32 inside, one rounding at the end) instead of
        # HF's cast, normalize, cast back and multiply: four passes, two roundings.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def _head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


@direct_call
class Linear(nn.Linear):
    """nn.Linear whose weight may be packed once for the CPU kernel (cpu_linear)."""

    packed: cpu_linear.PackedLinear | None = None

    def kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The cheapest callable computing this layer: the packed weight, else the module."""
        return self.packed if self.packed is not None else self

    def pack(self, arena: cpu_linear.WeightArena | None = None) -> None:
        self._set_packed(cpu_linear.PackedLinear(self.weight, self.bias, arena))

    def _set_packed(self, packed: cpu_linear.PackedLinear) -> None:
        """From now on the packed copy is the weight: the loaded one is freed, so a model
        does not hold its linear weights twice (an 8B model: 16 GB twice in bf16)."""
        self.packed = packed
        self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


def _empty_linear(
    in_features: int, out_features: int, bias: bool, cls: type[Linear] = Linear
) -> Linear:
    # Every weight is overwritten by load_weights; skip the random initialization.
    return cls(in_features, out_features, bias=bias, device="meta").to_empty(
        device=torch.get_default_device()
    )


@direct_call
class RowParallelLinear(Linear):
    """Holds the input columns of this rank's shard; the partial products are summed
    over ranks before the (full, unsharded) bias is added once."""

    parallel: ParallelContext = NO_PARALLEL

    def pack(self, arena: cpu_linear.WeightArena | None = None) -> None:
        sharded = self.parallel.world_size > 1
        bias = None if sharded else self.bias
        self._set_packed(cpu_linear.PackedLinear(self.weight, bias, arena))

    def kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        # Sharded, the partial products still need the all-reduce in forward.
        return super().kernel() if self.parallel.world_size == 1 else self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return super().forward(x)
        partial = F.linear(x, self.weight) if self.packed is None else self.packed(x)
        out = self.parallel.all_reduce(partial)
        return out if self.bias is None else out + self.bias


def _row_parallel(
    in_features: int, out_features: int, bias: bool, parallel: ParallelContext
) -> RowParallelLinear:
    layer = _empty_linear(in_features, out_features, bias, RowParallelLinear)
    assert isinstance(layer, RowParallelLinear)
    layer.parallel = parallel
    return layer


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, end) of the vocabulary; ids outside the slice embed
    to zero and the all-reduce leaves every token the one rank's row that has it."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.start, self.end = parallel.shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return F.embedding(input_ids, self.weight)
        inside = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(inside, input_ids - self.start, 0)
        out = F.embedding(local, self.weight).masked_fill_(~inside[:, None], 0.0)
        return self.parallel.all_reduce(out)


@direct_call
class LlamaAttention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        attention: AttentionBackend,
        parallel: ParallelContext = NO_PARALLEL,
    ):
        super().__init__()
        hidden = hf_config.hidden_size
        # This rank's heads (all of them without tensor parallelism).
        self.shard = parallel.head_shard(*_num_heads(hf_config))
        self.num_heads = self.shard.num_heads
        self.num_kv_heads = self.shard.num_kv_heads
        self.head_dim = _head_dim(hf_config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.num_qk_heads = self.num_heads + self.num_kv_heads
        # Llama's attention_bias covers q, k, v and o; Qwen2 always has q/k/v bias, no o.
        llama_bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias = llama_bias or getattr(hf_config, "model_type", "") == "qwen2"
        self.qkv_proj = _empty_linear(hidden, self.q_size + 2 * self.kv_size, qkv_bias)
        self.o_proj = _row_parallel(self.q_size, hidden, llama_bias, parallel)
        self.layer_idx = layer_idx
        self.attention = attention  # not a submodule: one backend serves every layer

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, rope: RopeStep) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # q and k rotate as one [T, heads + kv_heads, D] block of the fused output.
        qk = rotary(qkv, rope, self.num_qk_heads)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.attention.forward(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))


@direct_call
class LlamaMLP(nn.Module):
    def __init__(self, hf_config: Any, parallel: ParallelContext = NO_PARALLEL):
        super().__init__()
        hidden = hf_config.hidden_size
        self.inter_start, self.inter_end = parallel.shard(hf_config.intermediate_size)
        inter = self.inter_end - self.inter_start
        bias = bool(getattr(hf_config, "mlp_bias", False))
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (Llama models use silu)")
        self.gate_up_proj = _empty_linear(hidden, 2 * inter, bias)
        self.down_proj = _row_parallel(inter, hidden, bias, parallel)
        self.inter = inter
        self.fused: cpu_linear.FusedMLP | None = None

    def pack(self, arena: cpu_linear.WeightArena | None = None) -> None:
        """With oneDNN, also pack gate and up apart for the post-op path (cpu_linear).
        (`arena` is for the own kernel's layout, which never runs this path.)"""
        if (
            not cpu_linear.uses_own_kernel()
            and self.down_proj.parallel.world_size == 1
            and self.gate_up_proj.bias is None
        ):
            self.fused = cpu_linear.FusedMLP(
                self.gate_up_proj.weight[: self.inter],
                self.gate_up_proj.weight[self.inter :],
                self.down_proj.weight,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        if self.fused is not None and x.shape[0] >= cpu_linear.FUSED_MLP_MIN_TOKENS:
            return self.fused(x)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@direct_call
class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, hf_config: Any, layer_idx: int, attention: AttentionBackend, parallel: ParallelContext
    ):
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, layer_idx, attention, parallel)
        self.mlp = LlamaMLP(hf_config, parallel)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        rope: RopeStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (this layer's MLP output, the residual stream before it).

        The residual stream is carried apart from the sublayer outputs so that each add
        happens inside the next norm (one pass over the activations, in the fused op);
        the first layer gets the embeddings as x and no residual.
        """
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, rotary, rope)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, hf_config: Any, attention: AttentionBackend, parallel: ParallelContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, parallel
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, i, attention, parallel)
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """interfaces.CausalLM for Llama-architecture checkpoints (HF names)."""

    def __init__(
        self,
        *,
        hf_config: Any,
        attention: AttentionBackend,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.parallel = parallel or NO_PARALLEL
        self.model = LlamaModel(hf_config, attention, self.parallel)
        theta, scaling = rope_parameters(hf_config)
        self.rotary = RotaryEmbedding(
            _head_dim(hf_config), hf_config.max_position_embeddings, theta, scaling
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # The LM head holds the same vocabulary rows as this rank's embedding slice.
        embed = self.model.embed_tokens
        self.lm_head: Linear | None = (
            None
            if self.tie_word_embeddings
            else _empty_linear(hf_config.hidden_size, embed.end - embed.start, False)
        )
        self._packed_head: cpu_linear.PackedLinear | None = None
        # What forward runs per layer: the modules, or their FusedCpuDecoderLayer.
        self.layer_fns: list[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = list(
            self.model.layers
        )
        # Or all of them at once, final norm included, where FusedCpuDecoder runs.
        self.decoder: FusedCpuDecoder | None = None
        self._arena: cpu_linear.WeightArena | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] long over the flat batch → hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, x.dtype)
        if self.decoder is not None:
            return self.decoder(x, rope)
        residual = None
        for layer in self.layer_fns:
            x, residual = layer(x, residual, self.rotary, rope)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] → fp32 logits [N, vocab]. With tensor parallelism each rank
        computes its vocabulary slice and rank 0 gathers them; the others get None."""
        # Packed (bf16 on CPU), the head gives fp32 logits itself (the own kernel unrounded):
        # converting them after was the one OpenMP region left in a batch-1 step (~60 us,
        # its thread asleep).
        head = self._packed_head if self.lm_head is None else self.lm_head.packed
        if head is not None:
            logits = head(hidden_states, torch.float32)
        elif self.lm_head is not None:
            logits = self.lm_head(hidden_states)
        else:
            logits = F.linear(hidden_states, self.model.embed_tokens.weight)
        logits = logits.float()  # a no-op where the head gave fp32
        return self.parallel.gather_last_dim(logits, self.config.vocab_size)

    def weight_buffer(self) -> torch.Tensor | None:
        """The packed weights in one buffer (bf16 on CPU with cpu_gemm), else None."""
        return None if self._arena is None else self._arena.packed()

    def process_weights_after_loading(self) -> None:
        """bf16 on CPU: pack every linear weight for the CPU kernel, and run each layer as a
        FusedCpuDecoderLayer over the fused CPU ops (the final norm through them too).
        Elsewhere the model keeps ATen's ops and the weights as loaded."""
        weight = self.model.embed_tokens.weight
        if cpu_linear.packing_supported(weight.dtype, weight.device):
            # Module order is a step's read order: layer by layer, qkv, o, gate-up, down.
            linears = [m.weight for m in self.modules() if isinstance(m, Linear)]
            arena = cpu_linear.WeightArena.for_weights(
                linears if self.lm_head is not None else [*linears, weight]
            )
            for module in self.modules():
                if isinstance(module, (Linear, LlamaMLP)):
                    module.pack(arena)
            if self.lm_head is None:  # tied: the head multiplies by the embedding matrix
                self._packed_head = cpu_linear.PackedLinear(weight, arena=arena)
            self._arena = arena
        if cpu_ops.supported(weight.dtype, weight.device):
            self.rotary.use_fused_op()
            assert self.rotary.cos_sin is not None
            self.model.norm.fused = True
            fused = [
                FusedCpuDecoderLayer(layer, self.rotary.cos_sin) for layer in self.model.layers
            ]
            self.layer_fns = list(fused)
            if FusedCpuDecoder.supported(fused):
                self.decoder = FusedCpuDecoder(fused, self.model.norm.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; raise on an unknown
        name, a wrong shape, and on parameters the checkpoint left unset."""
        if any(isinstance(m, Linear) and m.packed is not None for m in self.modules()):
            raise RuntimeError(
                "the linear weights were packed (process_weights_after_loading) and their "
                "loaded copies freed: load weights into a fresh model"
            )
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # some tied checkpoints store the shared matrix twice
            target, shard = _fused_target(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            dest = params[target].data
            if self.parallel.world_size > 1:
                tensor = self._rank_slice(target, shard, tensor)
            if shard is not None:
                sizes = self._shard_sizes(target)
                start = sum(sizes[:shard])
                dest = dest[start : start + sizes[shard]]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add((target, shard))
        expected = {
            (name, shard)
            for name in params
            for shard in (range(len(self._shard_sizes(name))) if _is_fused(name) else [None])
        }
        missing = sorted(f"{name}[{shard}]" for name, shard in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")

    def _shard_sizes(self, fused_name: str) -> tuple[int, ...]:
        """Row counts of the checkpoint tensors stacked into a fused parameter, in order
        (this rank's rows under tensor parallelism)."""
        if ".qkv_proj." in fused_name:
            attn = self.model.layers[0].self_attn
            return (attn.q_size, attn.kv_size, attn.kv_size)
        mlp = self.model.layers[0].mlp
        return (mlp.inter_end - mlp.inter_start,) * 2

    def _rank_slice(self, target: str, shard: int | None, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a full checkpoint tensor this rank holds in `target`."""
        heads = self.model.layers[0].self_attn.shard
        head_dim = _head_dim(self.config)
        mlp = self.model.layers[0].mlp
        module, leaf = target.split(".")[-2:]
        if module == "qkv_proj":  # column-parallel: this rank's heads' rows
            start, end = (
                (heads.q_start, heads.q_end) if shard == 0 else (heads.kv_start, heads.kv_end)
            )
            return tensor[start * head_dim : end * head_dim]
        if module == "gate_up_proj":
            return tensor[mlp.inter_start : mlp.inter_end]
        if leaf == "bias":  # row-parallel biases are added once, after the all-reduce
            return tensor
        if module == "o_proj":  # row-parallel: the input columns of this rank's heads
            return tensor[:, heads.q_start * head_dim : heads.q_end * head_dim]
        if module == "down_proj":
            return tensor[:, mlp.inter_start : mlp.inter_end]
        if module in ("embed_tokens", "lm_head"):  # vocab-parallel rows
            embed = self.model.embed_tokens
            return tensor[embed.start : embed.end]
        return tensor  # norms: replicated


# HF projection → (our fused projection, its index among the fused ones).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _fused_target(name: str) -> tuple[str, int | None]:
    """HF parameter name → (our parameter name, shard index inside it, or None)."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in _FUSED:
        return name, None
    fused, shard = _FUSED[parts[-2]]
    return ".".join([*parts[:-2], fused, parts[-1]]), shard


def _num_heads(hf_config: Any) -> tuple[int, int]:
    heads = hf_config.num_attention_heads
    return heads, getattr(hf_config, "num_key_value_heads", None) or heads


def _is_fused(name: str) -> bool:
    return ".qkv_proj." in name or ".gate_up_proj." in name
