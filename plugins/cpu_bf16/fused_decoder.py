"""The fused_cpu_decoder model pass (interfaces.model.ModelPass): bf16 on a CPU, every
decoder layer whose structure it can run becomes a FusedCpuDecoderLayer (fused_layer.py),
and where it took every layer of a single-rank model whose linears cpu_gemm.cpp packed,
the whole stack runs as one C++ op for the row counts the plan gives cpu_gemm
(fused_stack.py); where every linear is instead another method's C++ call (the int8 W8A8
method's), the whole stack runs over those calls at every row count. It declines, with the reason, each layer it cannot run; those keep the
modules the model file built.

It takes a PreNormDecoderLayer of the shared layers: plain RMSNorms (x / rms(x) * w) on
each side of attention, the shared Attention (with or without Qwen3's RMSNorm q/k norm;
rotating by the model's table, over whole heads or a partial rotary factor's first
dimensions, or not at all in SmolLM3's NoPE layers; biases, windows, soft-caps and scales
are the linears' and the attention backend's), and a dense GatedMLP computing SiLU. So
Llama, Qwen2, Qwen3, Mistral, Phi-3 and SmolLM3 run fused; Gemma's sandwich norms and
GELU, and the experts of Mixtral and Qwen3-MoE, do not (a mixture-of-experts model's
dense layers do). Under tensor parallelism each rank's layers run fused, the whole stack
never (a row-parallel shard needs the all-reduce the module makes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from plugserve.capabilities import has_kernel_plan
from plugserve.interfaces.model import DecoderFrame, EncoderFrame, LayerRoute
from plugserve.worker.layers.attention import Attention
from plugserve.worker.layers.decoder_layer import PreNormDecoderLayer
from plugserve.worker.layers.mlp import GatedMLP
from plugserve.worker.layers.norm import RMSNorm
from plugserve_plugins.cpu_bf16.cpu_features import fused_layers_unsupported_reason
from plugserve_plugins.cpu_bf16.fused_layer import FusedCpuDecoderLayer
from plugserve_plugins.cpu_bf16.fused_mlp import FusedMLP
from plugserve_plugins.cpu_bf16.fused_stack import FusedCpuDecoder
from plugserve_plugins.cpu_bf16.kernel_plan import ROW_BUCKETS, KernelPlan
from plugserve_plugins.cpu_bf16.linear_method import PackedCpuBf16

FUSED_LAYER = "fused bf16 CPU layer"


class FusedCpuDecoderPass:
    """interfaces.model.ModelPass: the fused bf16 CPU decoder (see the module docstring)."""

    def apply(self, model: DecoderFrame | EncoderFrame) -> list[LayerRoute]:
        layers = list(model.layers)
        if not isinstance(model, DecoderFrame):
            return []  # an encoder: fused_encoder.py's
        reason = model_unsupported_reason(model)
        if reason is not None:
            return [LayerRoute(False, FUSED_LAYER, reason)] * len(layers)
        reasons = [
            layer_unsupported_reason(layer)
            if model.layer_fns[i] is layer
            else "an earlier model pass replaced it"
            for i, layer in enumerate(layers)
        ]
        taken = [i for i, why in enumerate(reasons) if why is None]
        if not taken:
            return [LayerRoute(False, FUSED_LAYER, str(why)) for why in reasons]

        rotary = model.rotary
        # A rotating layer left to its modules still needs the ATen path's cos and sin.
        generic_rotates = any(
            why is not None and _rotates(layer) for layer, why in zip(layers, reasons, strict=True)
        )
        rotary.use_fused_op(gather=generic_rotates)
        norm = model.final_norm
        if type(norm) is RMSNorm:
            norm.fused = True
        plan = _kernel_plan(layers[taken[0]])
        fused = {
            i: FusedCpuDecoderLayer(layers[i], rotary.cos_sin, _fused_mlp(layers[i]), plan)
            for i in taken
        }
        for i, layer in fused.items():
            model.layer_fns[i] = layer

        stack_reason = whole_stack_unsupported_reason(model, reasons)
        if stack_reason is None:
            stack_reason = FusedCpuDecoder.unsupported_reason(list(fused.values()))
        if stack_reason is None:
            stack = FusedCpuDecoder(list(fused.values()), norm.weight, plan, rotary.cos_sin)
            model.install_stack(stack)
            why = _stack_rows(stack.runs_bucket)
        else:
            why = f"layer by layer, not the whole stack as one op: {stack_reason}"
        return [
            LayerRoute(True, _variant(layers[i]), why)
            if i in fused
            else LayerRoute(False, FUSED_LAYER, str(reasons[i]))
            for i in range(len(layers))
        ]


def model_unsupported_reason(model: DecoderFrame) -> str | None:
    """Why the pass takes none of `model`'s layers (None where it may take some)."""
    weight = _norm_weight(model)
    if weight is None:
        return "the model has no norm weight to tell its dtype and device by"
    reason = fused_layers_unsupported_reason(weight)
    if reason is not None:
        return reason
    if not hasattr(torch.ops.plugserve_ops, "rms_norm_heads"):
        return "core's fused CPU ops (cpu_ops.cpp) lack rms_norm_heads"
    return None


def _norm_weight(model: DecoderFrame) -> torch.Tensor | None:
    """The final norm's weight, or on a pipeline stage before the last (which holds no
    final norm) its first layer's input norm's."""
    for norm in (
        model.final_norm,
        *(getattr(layer, "input_layernorm", None) for layer in model.layers[:1]),
    ):
        weight = getattr(norm, "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight
    return None


def layer_unsupported_reason(layer: nn.Module) -> str | None:
    """Why FusedCpuDecoderLayer cannot run `layer` (None where it can)."""
    if type(layer) is not PreNormDecoderLayer:
        return f"it is a {type(layer).__name__}, not a PreNormDecoderLayer"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(norm) is not RMSNorm for norm in norms):
        names = sorted({type(norm).__name__ for norm in norms} - {"RMSNorm"})
        return f"its norms are {', '.join(names)}, not RMSNorm"
    if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
        return "its two norms differ in epsilon"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not Attention:
        return f"its attention is a {type(attn).__name__}, not the shared Attention"
    qk_norms = (attn.q_norm, attn.k_norm)
    if any(norm is not None for norm in qk_norms) and any(
        type(norm) is not RMSNorm for norm in qk_norms
    ):
        return "its q/k norm is not an RMSNorm over each head"
    if type(mlp) is not GatedMLP:
        return f"its MLP is a {type(mlp).__name__}, not a dense GatedMLP"
    if mlp.hidden_act != "silu":
        return f"its MLP computes {mlp.hidden_act}, the fused layer SiLU"
    return None


def whole_stack_unsupported_reason(
    model: DecoderFrame, reasons: Sequence[str | None]
) -> str | None:
    """Why the stack cannot run as one op, before looking at the linears (None: it may)."""
    if model.world_size > 1:
        return "tensor-parallel ranks (a row-parallel shard needs its all-reduce)"
    left = [str(i) for i, why in enumerate(reasons) if why is not None]
    if left:
        return f"layers {','.join(left)} run their modules"
    if not isinstance(getattr(model.final_norm, "weight", None), torch.Tensor):
        return "the final norm lives on a later pipeline stage"
    if type(model.final_norm) is not RMSNorm:
        return f"the final norm is a {type(model.final_norm).__name__}"
    return None


def _rotates(layer: nn.Module) -> bool:
    attn = getattr(layer, "self_attn", None)
    return bool(getattr(attn, "rotate", True))


def _kernel_plan(layer: PreNormDecoderLayer) -> KernelPlan | None:
    method = layer.self_attn.qkv_proj.method
    return method.kernel_plan if has_kernel_plan(method) else None


def _fused_mlp(layer: PreNormDecoderLayer) -> FusedMLP | None:
    method = layer.mlp.down_proj.method
    return method.fused_mlp(layer.mlp) if isinstance(method, PackedCpuBf16) else None


def _variant(layer: PreNormDecoderLayer) -> str:
    """FUSED_LAYER, with what sets this layer apart: q/k norm, no rotation."""
    attn = layer.self_attn
    parts = [FUSED_LAYER]
    if attn.q_norm is not None:
        parts.append("with q/k norm")
    if not attn.rotate:
        parts.append("without rotation (NoPE)")
    return ", ".join(parts)


def _stack_rows(runs_bucket: Sequence[bool]) -> str:
    stack = [b.name for b, runs in zip(ROW_BUCKETS, runs_bucket, strict=True) if runs]
    layers = [b.name for b, runs in zip(ROW_BUCKETS, runs_bucket, strict=True) if not runs]
    line = f"the whole stack as one op (cpu_decoder.cpp) at {', '.join(stack)} rows"
    return line + (f", layer by layer at {', '.join(layers)} rows" if layers else "")
