"""The whole layer stack of a single-rank bf16 model as one C++ op (cpu_decoder.cpp), over
the layers the fused_cpu_decoder pass built (fused_layer.py) and either the weights
cpu_gemm.cpp packed or every linear's own C++ call (capabilities.SupportsCpuLinearCall: a
quantized linear method's kernels): what the decoder frame calls instead of its layer loop
and final norm (interfaces.model.WholeStack) for the steps whose row count the plan gives
cpu_gemm, or, over linear calls, for every step (each call runs its own kernel plan)."""

from __future__ import annotations

from typing import Any

import torch

from plugserve.capabilities import supports_cpu_linear_call, supports_fused_cpu_layer
from plugserve.ops.kernel_timing import bucket_index
from plugserve_plugins.cpu_bf16.cpu_features import decoder_unavailable_reason
from plugserve_plugins.cpu_bf16.fused_layer import FusedCpuDecoderLayer, Matmul
from plugserve_plugins.cpu_bf16.kernel_plan import ROW_BUCKETS, STREAM_NON_TEMPORAL, KernelPlan
from plugserve_plugins.cpu_bf16.packed_linear import PackedLinear


class FusedCpuDecoder:
    """Called as (embeddings, rope) → final-normed hidden states.

    Where the attention backend offers its kernel as a C++ call, the whole stack is one op
    (decode_layers). Otherwise, between two calls of the backend's forward, it makes one op
    call (decode_stretch: o_proj, the norms, the MLP, the next layer's qkv, its q/k norm
    and RoPE), where FusedCpuDecoderLayer makes eight and a frame. The final norm is the
    last stretch's "next" norm. Same ops in the same order as FusedCpuDecoderLayer
    (tested).
    """

    @staticmethod
    def unsupported_reason(layers: list[FusedCpuDecoderLayer]) -> str | None:
        """Why these layers cannot run as one op (None where they can): every linear needs
        a cpu_gemm-packed weight on one rank (a row-parallel shard's all-reduce needs the
        module), or every linear a C++ call, every layer the same heads, and the op must
        build."""
        if not layers:
            return "no layers"
        linears = [
            linear
            for layer in layers
            for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ]
        packed = all(isinstance(m, PackedLinear) and m.own_kernel for m in linears)
        if not packed and not all(supports_cpu_linear_call(m) for m in linears):
            return "not every linear has cpu_gemm.cpp's packed weight or a C++ call"
        shapes = {(layer.heads, layer.head_dim) for layer in layers}
        if len(shapes) > 1:
            return "the layers differ in their heads"
        return decoder_unavailable_reason()

    def __init__(
        self,
        layers: list[FusedCpuDecoderLayer],
        final_norm: torch.Tensor,
        plan: KernelPlan | None,
        cos_sin: torch.Tensor,
    ) -> None:
        """`plan`: the bf16 kernel plan of cpu_gemm-packed linears; None where every linear
        is a C++ call."""
        self.layers = layers
        first = layers[0]
        # Every stretch's weights, held in C++ once (decode_stretch, decode_layers).
        self.stack = torch.classes.plugserve_decoder.LayerStack(
            cos_sin, first.heads[0], first.heads[1], first.head_dim
        )
        self.attention = first.attention
        # Asked once: a Protocol check costs microseconds, too many for every step.
        self.offers_layer_call = supports_fused_cpu_layer(self.attention)
        if plan is None:
            # Over linear calls, every step: each call picks its kernel by its row count.
            self.runs_bucket = tuple(True for _ in ROW_BUCKETS)
            self.mode_by_bucket = tuple(STREAM_NON_TEMPORAL for _ in ROW_BUCKETS)
            self._add_called_layers(final_norm)
            return
        # The steps it runs: those whose row count the plan gives cpu_gemm, each in its
        # bucket's mode (a one-row stream, the vector tiles, AMX tiles); the others run
        # layer by layer, each linear through its plan's kernel.
        self.runs_bucket = tuple(kernel.library == "own" for kernel in plan.by_bucket)
        self.mode_by_bucket = tuple(kernel.one_row_mode for kernel in plan.by_bucket)
        for layer, following in zip(layers, [*layers[1:], None], strict=True):
            o, gate_up, down = map(_packed, (layer.o_proj, layer.gate_up_proj, layer.down_proj))
            qkv = None if following is None else _packed(following.qkv_proj)
            self.stack.add_layer(
                layer.layer_idx,
                o.weight,
                o.own_bias,
                layer.post_attention_norm,
                gate_up.weight,
                gate_up.own_bias,
                down.weight,
                down.own_bias,
                final_norm if following is None else following.input_norm,
                layer.eps,
                None if qkv is None else qkv.weight,
                None if qkv is None else qkv.own_bias,
                0 if qkv is None else qkv.out_features,
                o.coded,
                gate_up.coded,
                down.coded,
                None if qkv is None else qkv.coded,
                # The next layer's q/k norm and whether it rotates.
                None if following is None else following.q_norm,
                None if following is None else following.k_norm,
                0.0 if following is None else following.qk_norm_eps,
                following is not None and following.cos_sin is not None,
            )

    def _add_called_layers(self, final_norm: torch.Tensor) -> None:
        """Every layer with its linears as C++ calls (no packed weights, no biases: each
        call adds its own)."""
        empty = torch.empty(0, dtype=final_norm.dtype)
        for index, (layer, following) in enumerate(
            zip(self.layers, [*self.layers[1:], None], strict=True)
        ):
            self.stack.add_layer(
                layer.layer_idx, empty, None, layer.post_attention_norm, empty, None,
                empty, None, final_norm if following is None else following.input_norm,
                layer.eps, None if following is None else empty, None,
                0,
                None, None, None, None,
                None if following is None else following.q_norm,
                None if following is None else following.k_norm,
                0.0 if following is None else following.qk_norm_eps,
                following is not None and following.cos_sin is not None,
            )  # fmt: skip
            linears = [layer.o_proj, layer.gate_up_proj, layer.down_proj]
            if following is not None:
                linears.append(following.qkv_proj)
            calls = [_linear_call(linear) for linear in linears] + [(0, 0)] * (4 - len(linears))
            self.stack.set_linear_calls(
                index, [fn for fn, _ in calls], [context for _, context in calls]
            )

    def runs(self, rows: int) -> bool:
        """Whether a step of `rows` tokens runs here (its kernel is cpu_gemm's)."""
        return self.runs_bucket[bucket_index(rows)]

    def __call__(self, x: torch.Tensor, rope: Any) -> torch.Tensor:
        ops = torch.ops.plugserve_ops
        decoder_ops = torch.ops.plugserve_decoder
        positions = rope.positions
        first = self.layers[0]
        residual = x
        qkv = first.qkv_proj(ops.rms_norm(x, first.input_norm, first.eps))
        first.norm_and_rotate(qkv, positions)
        # Where the backend offers its kernel as a C++ call (for this step: it may offer it
        # only for some), decode_layers runs every layer in one op.
        mode = self.mode_by_bucket[bucket_index(x.shape[0])]
        call = self.attention.cpu_layer_call() if self.offers_layer_call else None
        if call is not None:
            return decoder_ops.decode_layers(self.stack, qkv, residual, positions, *call, mode)
        for index, layer in enumerate(self.layers):
            qkv = decoder_ops.decode_stretch(
                self.stack, index, layer.attend(qkv), residual, positions, mode
            )
        return qkv  # after the last layer, the final-normed hidden states


def _linear_call(linear: Matmul) -> tuple[int, int]:
    assert supports_cpu_linear_call(linear)
    return linear.cpu_linear_call()


def _packed(linear: Matmul) -> PackedLinear:
    assert isinstance(linear, PackedLinear)
    return linear
