"""The fused_cpu_encoder model pass (interfaces.model.ModelPass): bf16 on a CPU, a BERT-style
encoder (interfaces.model.EncoderFrame) whose every linear cpu_gemm.cpp packed runs its
layers through one C++ op per layer (cpu_encoder.cpp's encode_stretch: the attention
output projection, add + LayerNorm, the MLP with GELU, add + LayerNorm and the next
layer's qkv), with the attention backend's forward called from Python in between, for
the steps whose row count the kernel plan gives cpu_gemm. The other steps, and every
model it declines (fp32, tensor-parallel ranks, ReLU, a linear another method computes),
run the modules the model file built.

A sentence embedder serves many requests of one short prompt: over a short prompt each
op of a layer is short too, and the module path's Python between them (frames, nn.Module
lookups, the gap in which OpenMP's threads fall asleep) is a share of the forward
(docs/benchmarks-history.md, "The fused encoder and the embeddings benchmark in turns"). The op runs the same kernels in the same order, so the two paths' outputs
are equal (tests/unit/cpu_bf16/test_fused_encoder.py).
"""

from __future__ import annotations

import torch
from torch import nn

from plugserve.capabilities import has_kernel_plan
from plugserve.interfaces.model import AttentionBackend, DecoderFrame, EncoderFrame, LayerRoute
from plugserve.ops.kernel_timing import bucket_index
from plugserve.worker.layers.encoder_layer import EncoderLayer
from plugserve.worker.layers.linear import Linear
from plugserve_plugins.cpu_bf16.cpu_features import (
    encoder_unavailable_reason,
    fused_layers_unsupported_reason,
)
from plugserve_plugins.cpu_bf16.kernel_plan import ROW_BUCKETS, KernelPlan
from plugserve_plugins.cpu_bf16.packed_linear import PackedLinear

FUSED_ENCODER_LAYER = "fused bf16 CPU encoder layer"


class FusedCpuEncoderPass:
    """interfaces.model.ModelPass: the fused bf16 CPU encoder (see the module docstring)."""

    def apply(self, model: DecoderFrame | EncoderFrame) -> list[LayerRoute]:
        if isinstance(model, DecoderFrame):
            return []  # a decoder: fused_decoder.py's
        layers = list(model.layers)
        reason = model_unsupported_reason(model)
        if reason is None:
            reason = next(filter(None, map(layer_unsupported_reason, layers)), None)
        if reason is not None:
            return [LayerRoute(False, FUSED_ENCODER_LAYER, reason)] * len(layers)
        assert isinstance(model, EncoderFrame)
        stack = FusedCpuEncoder(layers)
        model.install_stack(stack)
        return [LayerRoute(True, FUSED_ENCODER_LAYER, _stack_rows(stack.runs_bucket))] * len(layers)


def model_unsupported_reason(model: DecoderFrame | EncoderFrame) -> str | None:
    """Why the pass takes none of `model`'s layers (None where it may take them all)."""
    if not isinstance(model, EncoderFrame):
        return "not an encoder (interfaces.model.EncoderFrame)"
    if model.world_size > 1:
        return "tensor-parallel ranks (a row-parallel shard needs its all-reduce)"
    if not model.layers:
        return "no layers"
    norm = getattr(model.layers[0], "output", None)
    weight = getattr(getattr(norm, "LayerNorm", None), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return "its first layer has no output LayerNorm to tell its dtype and device by"
    return fused_layers_unsupported_reason(weight) or encoder_unavailable_reason()


def layer_unsupported_reason(layer: nn.Module) -> str | None:
    """Why the stack cannot run `layer` (None where it can)."""
    if type(layer) is not EncoderLayer:
        return f"a layer is a {type(layer).__name__}, not an EncoderLayer"
    if layer.intermediate.cpu_ops_tanh is None:
        return "its activation is not a GELU"
    linears = (
        layer.attention.self.qkv_proj,
        layer.attention.output.dense,
        layer.intermediate.dense,
        layer.output.dense,
    )
    if not all(_packed(linear) is not None for linear in linears):
        return "not every linear has cpu_gemm.cpp's packed weight"
    norms = (layer.attention.output.LayerNorm, layer.output.LayerNorm)
    if any(type(norm) is not nn.LayerNorm or norm.weight is None for norm in norms):
        return "its norms are not LayerNorms with a weight and a bias"
    if norms[0].eps != norms[1].eps:
        return "its two LayerNorms differ in epsilon"
    return None


class FusedCpuEncoder:
    """interfaces.model.WholeEncoderStack: the embeddings' output → the last layer's
    hidden states, one encode_stretch per layer between the attention backend's calls."""

    def __init__(self, layers: list[nn.Module]) -> None:
        first = layers[0].attention.self
        self.heads, self.head_dim = first.num_heads, first.head_dim
        self.first_qkv = _packed(first.qkv_proj)
        self.attention: AttentionBackend = first.attention
        self.layer_indices = [layer.attention.self.layer_idx for layer in layers]
        plan = _kernel_plan(first.qkv_proj)
        # The steps it runs: those whose row count the plan gives cpu_gemm, each in its
        # bucket's mode; the others run the modules, each linear through its plan's kernel.
        self.runs_bucket = tuple(kernel.library == "own" for kernel in plan.by_bucket)
        self.mode_by_bucket = tuple(kernel.one_row_mode for kernel in plan.by_bucket)
        self.stack = torch.classes.plugserve_encoder.EncoderStack()
        self.stretch = torch.ops.plugserve_encoder.encode_stretch
        for layer, following in zip(layers, [*layers[1:], None], strict=True):
            o, up, down = map(
                _packed,
                (layer.attention.output.dense, layer.intermediate.dense, layer.output.dense),
            )
            qkv = None if following is None else _packed(following.attention.self.qkv_proj)
            attention_norm, output_norm = layer.attention.output.LayerNorm, layer.output.LayerNorm
            self.stack.add_layer(
                o.weight,
                o.own_bias,
                attention_norm.weight,
                attention_norm.bias,
                up.weight,
                up.own_bias,
                down.weight,
                down.own_bias,
                output_norm.weight,
                output_norm.bias,
                attention_norm.eps,
                bool(layer.intermediate.cpu_ops_tanh),
                None if qkv is None else qkv.weight,
                None if qkv is None else qkv.own_bias,
                0 if qkv is None else qkv.out_features,
            )

    def runs(self, rows: int) -> bool:
        """Whether a step of `rows` tokens runs here (its kernel is cpu_gemm's)."""
        return self.runs_bucket[bucket_index(rows)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        heads, head_dim = self.heads, self.head_dim
        mode = self.mode_by_bucket[bucket_index(rows)]
        qkv = self.first_qkv(x)
        for index, layer_idx in enumerate(self.layer_indices):
            by_head = qkv.view(rows, 3 * heads, head_dim)
            attended = self.attention.forward(
                layer_idx,
                by_head[:, :heads],
                by_head[:, heads : 2 * heads],
                by_head[:, 2 * heads :],
            )
            x, *following = self.stretch(self.stack, index, attended.view(rows, -1), x, mode)
            if following:
                qkv = following[0]
        return x


def _packed(linear: Linear) -> PackedLinear | None:
    """The linear's cpu_gemm-packed weight, where its method installed one."""
    compute = linear.kernel()
    return compute if isinstance(compute, PackedLinear) and compute.own_kernel else None


def _kernel_plan(linear: Linear) -> KernelPlan:
    method = getattr(linear, "method", None)
    assert has_kernel_plan(method), "a packed linear's method has a kernel plan"
    return method.kernel_plan


def _stack_rows(runs_bucket: tuple[bool, ...]) -> str:
    stack = [b.name for b, runs in zip(ROW_BUCKETS, runs_bucket, strict=True) if runs]
    layers = [b.name for b, runs in zip(ROW_BUCKETS, runs_bucket, strict=True) if not runs]
    line = f"one op per layer (cpu_encoder.cpp) at {', '.join(stack) or 'no'} rows"
    return line + (f", the modules at {', '.join(layers)} rows" if layers else "")
