"""The model side: what a layer's attention computes, the attention backend, the linear
layer and its method, the model architecture, and the passes that may change how a loaded
model's layers run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes beyond full causal softmax(q.k / sqrt(head_dim)) v.

    The model class says it per layer (capabilities.HasLayerAttention); a backend applies
    them in this order: scores = q.k * scale, then soft-capping, then the causal (and
    window) mask, then softmax in fp32.
    """

    # Each query attends to the last `sliding_window` positions, itself included: key
    # position j is seen from query position i when i - sliding_window < j <= i
    # (transformers' sliding_window_overlay). None: the whole context.
    sliding_window: int | None = None
    # scores → logit_softcap * tanh(scores / logit_softcap), after scaling (Gemma 2).
    logit_softcap: float | None = None
    # The softmax scale; None: 1 / sqrt(head_dim) (Gemma: query_pre_attn_scalar ** -0.5).
    scale: float | None = None
    # Every query sees every key of its own prompt, later ones included (an encoder's
    # layers: BERT, XLM-R). Such a prompt runs in one forward pass with no context
    # before it, so there is no mask at all.
    bidirectional: bool = False

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive, got {self.logit_softcap}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"scale must be positive, got {self.scale}")
        if self.bidirectional and self.sliding_window is not None:
            raise ValueError("a bidirectional layer attends over its whole prompt: no window")

    @property
    def is_full(self) -> bool:
        """Plain full causal attention with the default scale."""
        return self == FULL_ATTENTION

    def softmax_scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)


FULL_ATTENTION = LayerAttention()


@dataclass(frozen=True)
class AttentionSpec:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    # One entry per layer, or empty: every layer full causal attention at the default scale.
    layers: tuple[LayerAttention, ...] = ()

    def __post_init__(self) -> None:
        if self.layers and len(self.layers) != self.num_layers:
            raise ValueError(
                f"AttentionSpec.layers has {len(self.layers)} entries for {self.num_layers} layers"
            )

    def layer(self, layer_idx: int) -> LayerAttention:
        """What layer `layer_idx` computes (FULL_ATTENTION where `layers` is empty)."""
        return self.layers[layer_idx] if self.layers else FULL_ATTENTION


@dataclass
class AttentionBatch:
    """One step's flat varlen batch, built on the host (numpy) by the model runner.

    Requests are rows; tokens of row i are query_start_loc[i]:query_start_loc[i+1] in the
    flat token axis. Prefill chunks and decodes of any lengths mix freely.
    """

    query_start_loc: np.ndarray  # int32 [num_reqs + 1]
    seq_lens: np.ndarray  # int32 [num_reqs]: context length after this step's tokens
    block_table: np.ndarray  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: np.ndarray  # int64 [num_tokens]: block_id * block_size + offset

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged KV cache layout and varlen attention; one instance serves every layer, each
    as spec.layer(layer_idx) says (window, soft-cap, scale).

    Optional: SupportsCudaGraphs, SupportsFusedCpuLayer, HasDtypes, HonoursLayerAttention
    (without it, only models whose layers are all full causal attention run on it)."""

    def __init__(self, *, spec: AttentionSpec) -> None: ...

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block takes across all layers (K and V); sizes the pool."""
        ...

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def prepare(self, batch: AttentionBatch) -> None:
        """Called once per step before the forward pass: move metadata to the device and
        plan kernels."""
        ...

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [tokens, heads, head_dim], k/v [tokens, kv_heads, head_dim]: write k/v into the
        cache at the step's slots, attend causally over each request's cached context, and
        return [tokens, heads, head_dim]. The inputs may be strided views (slices of the
        fused QKV projection); a kernel that needs contiguous memory copies."""
        ...


# (x [M, K], out_dtype=None) -> x @ weight.T + bias [M, N], in out_dtype (default x's dtype):
# what a linear method installs on a layer. The LM head asks for fp32 logits.
LinearCompute = Callable[..., "torch.Tensor"]


class LinearLayer(Protocol):
    """What a linear method sees of the layer it runs (plugserve.worker.layers.linear.Linear):
    y = x @ weight.T + bias over this tensor-parallel rank's shard of the weight.

    The parameters are the method's: it creates them (`add_parameter`), and the layer's
    weight loader places this rank's rows of each checkpoint tensor in them, through the
    method's `load_weight`. A method that keeps the checkpoint's layout names them
    `weight` [out_features, in_features] and `bias` [out_features] (or None), as
    PlainLinearMethod does; the bf16 CPU kernels and the fused CPU decoder read
    those two."""

    in_features: int  # this rank's
    out_features: int  # this rank's
    has_bias: bool

    def add_parameter(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
    ) -> torch.nn.Parameter:
        """A new parameter `name` on the layer (the model's dtype where `dtype` is None, on
        the model's device), loaded through the layer's weight loader."""
        ...

    @property
    def matmul_bias(self) -> torch.Tensor | None:
        """The bias the matmul itself adds: None for a row-parallel shard, which adds its
        bias once, after summing the partial products over ranks."""
        ...

    def install(self, compute: LinearCompute) -> None:
        """From now on `compute` is the layer's matmul (its forward calls it, and the fused
        CPU layers call it directly); the layer's loaded parameters are freed."""
        ...


class TiedLmHead(Protocol):
    """An embedding matrix that is also the LM head (a checkpoint with tied embeddings). A
    method may install a callable for the logits; the embedding lookup keeps its rows."""

    weight: torch.Tensor  # [vocab rows of this rank, hidden]

    def install_head(self, compute: LinearCompute) -> None: ...


@runtime_checkable
class LinearMethod(Protocol):
    """How linear layers hold and multiply their weights, selected by `stack.linear_method`
    (None: chosen by dtype and device, plugserve.worker.linear_methods). Built once per
    model load with no arguments (or `options=`); one object runs every layer given it.

    Given to each linear layer after the model is built and before its weights load:
    `create_weights` (per layer), `load_weight` (per checkpoint tensor),
    `process_weights_after_loading` (once, with all the method's layers), then `apply` on
    every forward of a layer on which the method installed nothing.

    Optional: ReportsUnavailability (a kernel this machine cannot run), DescribesLinears
    (its start-up log line), HasKernelPlan (the bf16 CPU kernel plan it measured),
    SupportsWeightBuffer (its packed weights, for the weight-read probe)."""

    def create_weights(self, layer: LinearLayer) -> None:
        """Create the layer's parameters (layer.add_parameter) for its checkpoint tensors."""
        ...

    def load_weight(
        self,
        layer: LinearLayer,
        param: torch.nn.Parameter,
        destination: torch.Tensor,
        loaded: torch.Tensor,
    ) -> None:
        """Write `loaded`, this rank's part of one checkpoint tensor, into `destination`,
        its place in `param` (a view of the same shape)."""
        ...

    def process_weights_after_loading(
        self,
        layers: Sequence[LinearLayer],
        *,
        model: torch.nn.Module,
        tied_head: TiedLmHead | None,
    ) -> None:
        """Once, after every weight of `model` loaded: `layers` are the layers given this
        method, in module order (the order a step runs them); `tied_head` the embedding
        that is also the LM head, where the model ties it and the head was given this
        method. Re-lay out, quantize or pack the weights here and `install` the result."""
        ...

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] → x @ weight.T + layer.matmul_bias [M, out_features], for a
        layer on which this method installed nothing."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """A model architecture registered through `register_models`.

    An architecture that supports tensor parallelism also accepts `parallel=` (a
    plugserve.worker.parallel.ParallelContext) and then holds only its rank's shard;
    it is passed only when the world size is above 1."""

    def __init__(self, *, hf_config: Any, attention: AttentionBackend) -> None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat token ids and positions → final hidden states [tokens, hidden]."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] → fp32 logits [N, vocab]: on rank 0 under tensor
        parallelism (gathered), None on the other ranks."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Weights under Hugging Face names."""
        ...


# ------------------------------------------------------------------ model passes


@dataclass(frozen=True)
class LayerRoute:
    """What a model pass says of one decoder layer: it took the layer (`taken`), and
    `path` names what runs it now (e.g. "fused bf16 CPU layer"), or it declined it, and
    `why` says why (e.g. "its MLP is a mixture of experts"). The start-up log groups the
    layers by what runs them and why."""

    taken: bool
    path: str
    why: str = ""


class WholeStack(Protocol):
    """A replacement for the decoder frame's layer loop and final norm that a model pass
    installs (DecoderFrame.install_stack), called as (x [T, hidden], rope: the step's
    rotary inputs) → final-normed hidden states [T, hidden]: the frame calls it for the
    steps whose token count it `runs`, and its own loop for the others."""

    def runs(self, rows: int) -> bool:
        """Whether a step of `rows` tokens runs here."""
        ...

    def __call__(self, x: torch.Tensor, rope: Any) -> torch.Tensor: ...


@runtime_checkable
class DecoderFrame(Protocol):
    """What a model pass sees of a decoder-only model and may change
    (plugserve.worker.models.decoder.DecoderForCausalLM offers it): the layer modules as
    built and loaded, what the forward pass calls per layer, the final norm, the rotary
    table and the tensor-parallel world size.

    Each entry of `layer_fns` is called as the layer module is, (x, residual, rotary,
    rope) → (output, residual), and a pass may replace it with any callable that computes
    the same; a pass may also install a WholeStack running every layer and the final norm
    at once."""

    @property
    def layers(self) -> Sequence[torch.nn.Module]:
        """The decoder layers, in order, as the model file built them."""
        ...

    layer_fns: MutableSequence[Any]
    # The whole-stack replacement a pass installed (install_stack), or None.
    whole_stack: WholeStack | None

    @property
    def final_norm(self) -> torch.nn.Module: ...

    @property
    def rotary(self) -> Any:
        """The rotary table the layers rotate by (plugserve.worker.layers.rotary)."""
        ...

    @property
    def world_size(self) -> int:
        """Tensor-parallel ranks the model is sharded over (1: unsharded)."""
        ...

    def install_stack(self, stack: WholeStack | None) -> None:
        """Run the whole stack through `stack` where it `runs` a step (None: never)."""
        ...


class WholeEncoderStack(Protocol):
    """A replacement for an encoder frame's layer loop that a model pass installs
    (EncoderFrame.install_stack), called as (x [T, hidden]: the embeddings' output) → the
    last layer's hidden states [T, hidden]: the frame calls it for the steps whose token
    count it `runs`, and its own loop for the others."""

    def runs(self, rows: int) -> bool:
        """Whether a step of `rows` tokens runs here."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class EncoderFrame(Protocol):
    """What a model pass sees of an encoder (a BERT-style model: embeddings, then layers
    that attend bidirectionally; plugserve.worker.models.bert.BertModel offers it): the
    layer modules as built and loaded and the tensor-parallel world size; a pass may
    install a WholeEncoderStack running every layer at once."""

    @property
    def layers(self) -> Sequence[torch.nn.Module]:
        """The encoder layers, in order, as the model file built them."""
        ...

    # The whole-stack replacement a pass installed (install_stack), or None.
    whole_stack: WholeEncoderStack | None

    @property
    def world_size(self) -> int:
        """Tensor-parallel ranks the model is sharded over (1: unsharded)."""
        ...

    def install_stack(self, stack: WholeEncoderStack | None) -> None:
        """Run the layers through `stack` where it `runs` a step (None: never)."""
        ...


@runtime_checkable
class ModelPass(Protocol):
    """A rewrite of how a loaded model's layers run, selected by `stack.model_passes`
    (None: the bundled automatic list, plugserve.config.AUTOMATIC_MODEL_PASSES). Built
    once per model load with no arguments (or `options=`), and applied once, after the
    linear methods processed the weights (plugserve.worker.model_passes), in the order
    the configuration lists the passes.

    A pass looks at the layers' structure, takes those it can run (replacing their
    entries in `layer_fns`, installing a whole-stack replacement) and leaves the others
    as they are; it never changes what a layer computes beyond rounding. A later pass
    sees what earlier ones installed."""

    def apply(self, model: DecoderFrame | EncoderFrame) -> Sequence[LayerRoute]:
        """Rewrite `model`'s layers; returns one LayerRoute per layer, in order (taken,
        and what runs it now; or declined, and why). A pass written for one kind of frame
        returns no routes at all for the other: it does not look at that model."""
        ...
