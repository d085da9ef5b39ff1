"""Capabilities: what a part may offer beyond its slot's Protocol (plugserve.interfaces).

Each is a small runtime-checkable Protocol with a `supports_x(obj)` (or `has_x`) check that
callers use instead of probing attributes with getattr, so every optional method is
declared and documented here, once (as vLLM's models/interfaces.py):

- any registered class: ReportsUnavailability (`reports_unavailability`);
- executors: HasTensorParallelLimit, SupportsWeightReadProbe, RunsBatchesConcurrently,
  CountsMessages;
- attention backends: SupportsCudaGraphs, SupportsFusedCpuLayer, HasDtypes,
  HonoursLayerAttention, SupportsBatchInvariance;
- models: SupportsWeightBuffer, HasLayerAttention, HasTiedLmHead, TakesTokenTypeIds,
  HasClassifier, HasContextLimit, SupportsPipelineStages;
- linear methods: DescribesLinears, HasKernelPlan (with its KernelMeasurement),
  SupportsWeightBuffer, SupportsBatchInvariance; what they install in a layer:
  SupportsCpuLinearCall;
- KV allocators: FreesBlocksPastTokens;
- structured-output grammars: SupportsGrammarRollback;
- speculative proposers: ProposesInWorker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeGuard, runtime_checkable

if TYPE_CHECKING:
    from concurrent.futures import Future
    from typing import Any

    import torch

    from plugserve.datatypes import (
        GrammarOutput,
        MessageCounts,
        ModelRunnerOutput,
        Request,
        SchedulerOutput,
    )
    from plugserve.interfaces.model import AttentionBatch, LayerAttention, TiedLmHead
    from plugserve.interfaces.speculative import ProposerModel, WorkerDraftRequests


# --------------------------------------------------------------------------- any registered class


@runtime_checkable
class ReportsUnavailability(Protocol):
    """A registered class that can tell it cannot run on this machine (a CUDA-only kernel
    on a CPU host, a missing package): selecting it then fails at config time with its
    reason, and the plugin matrix skips its cells with that reason."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """A one-line reason it cannot run here, or None when it can."""
        ...


def reports_unavailability(cls: object) -> TypeGuard[type[ReportsUnavailability]]:
    return isinstance(cls, ReportsUnavailability)


# --------------------------------------------------------------------------- executors


@runtime_checkable
class HasTensorParallelLimit(Protocol):
    """An executor class that runs at most this many ranks (without it: no limit)."""

    max_tensor_parallel_size: int


def has_tensor_parallel_limit(cls: object) -> TypeGuard[type[HasTensorParallelLimit]]:
    return isinstance(cls, HasTensorParallelLimit)


@runtime_checkable
class SupportsWeightReadProbe(Protocol):
    """An executor that can measure how fast the model's weights read now, where they lie:
    the bandwidth floor the benchmarks judge a batch-1 step against."""

    def measure_weight_read(self, seconds: float) -> tuple[int, float]:
        """(weight bytes, bytes/s), reading for about `seconds`; ValueError where it
        cannot tell (the model keeps no single weight buffer)."""
        ...


def supports_weight_read_probe(executor: object) -> TypeGuard[SupportsWeightReadProbe]:
    return isinstance(executor, SupportsWeightReadProbe)


@runtime_checkable
class RunsBatchesConcurrently(Protocol):
    """An executor that keeps several batches in flight (pipeline stages working on
    consecutive batches). The engine then keeps a queue of submitted batches, up to
    `max_concurrent_batches`, and never schedules a request that is in one of them."""

    @property
    def max_concurrent_batches(self) -> int:
        """How many batches may be in flight at once (1: the engine steps as usual)."""
        ...

    def submit_batch(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None
    ) -> Future[ModelRunnerOutput]:
        """Phases 7 and 8 of one batch, its grammar bitmask given up front; returns at
        once. The Futures resolve in submission order."""
        ...


def runs_batches_concurrently(executor: object) -> TypeGuard[RunsBatchesConcurrently]:
    return isinstance(executor, RunsBatchesConcurrently)


@runtime_checkable
class CountsMessages(Protocol):
    """An executor that counts the messages crossing process boundaries on its behalf:
    between the engine and its ranks, and among the ranks (datatypes.MessageCounts)."""

    def message_counts(self) -> MessageCounts:
        """Totals since start, over every rank it reaches; asked between steps (batches
        in flight are waited for first)."""
        ...


def counts_messages(executor: object) -> TypeGuard[CountsMessages]:
    return isinstance(executor, CountsMessages)


# --------------------------------------------------------------------------- attention backends


@runtime_checkable
class SupportsCudaGraphs(Protocol):
    """An attention backend that can run inside CUDA graphs (see worker/cuda_graphs.py);
    without this capability decode steps run eagerly."""

    def init_cuda_graphs(self, sizes: Sequence[int], max_blocks_per_req: int) -> None:
        """Allocate the static metadata buffers the graphs read, once, after
        allocate_kv_cache."""
        ...

    def prepare_graph(self, batch: AttentionBatch, padded_size: int) -> None:
        """Like prepare(), into those buffers, for a batch of one-token rows padded to
        `padded_size` with rows that touch only scratch KV memory."""
        ...


def supports_cuda_graphs(attention: object) -> TypeGuard[SupportsCudaGraphs]:
    return isinstance(attention, SupportsCudaGraphs)


@runtime_checkable
class SupportsBatchInvariance(Protocol):
    """A linear method or attention backend that can compute each row of its output the
    same, to the bit, whatever other rows share the call: every reduction over a row (a
    matmul's sums over K, attention's over the context) in one order at every batch size,
    chunking of the prompt and step composition (engine.batch_invariant). Parts without it
    are refused by name when the mode is on."""

    def use_batch_invariant_order(self) -> None:
        """Keep each row's reductions in one order from now on. Called once, before a
        linear method processes its weights and before an attention backend allocates its
        cache; raises ValueError naming why where this instance cannot (its device, dtype,
        options, or a kernel that does not run on this machine)."""
        ...


def supports_batch_invariance(part: object) -> TypeGuard[SupportsBatchInvariance]:
    return isinstance(part, SupportsBatchInvariance)


@runtime_checkable
class SupportsFusedCpuLayer(Protocol):
    """A CPU attention backend whose kernel is C++ and can be called from C++: the fused
    bf16 CPU decoder then runs every layer of a step in one op instead of calling
    `forward` from Python per layer."""

    def cpu_layer_call(self) -> tuple[int, int] | None:
        """Two addresses: a `plugserve::LayerAttentionFn` (plugserve/ops/include/
        layer_attention.h) and the state it takes for the step prepared last, valid until
        the next prepare(); None keeps the per-layer calls for this step."""
        ...


def supports_fused_cpu_layer(attention: object) -> TypeGuard[SupportsFusedCpuLayer]:
    return isinstance(attention, SupportsFusedCpuLayer)


@runtime_checkable
class HasDtypes(Protocol):
    """An attention backend class whose kernels compute only in these model dtypes (torch
    dtype names, e.g. ("bfloat16", "float16")); the plugin matrix tests it in those only.
    Without it, float32 and bfloat16 are assumed."""

    dtypes: tuple[str, ...]


def has_dtypes(cls: object) -> TypeGuard[type[HasDtypes]]:
    return isinstance(cls, HasDtypes)


@runtime_checkable
class HonoursLayerAttention(Protocol):
    """An attention backend class that applies these per-layer options of
    AttentionSpec.layers (interfaces.model.LayerAttention field names: "sliding_window",
    "logit_softcap", "scale"). Without it a backend computes full causal attention at
    1/sqrt(head_dim) only, and a model whose layers need more fails to start with it."""

    layer_attention_options: frozenset[str]


def honours_layer_attention(cls: object) -> TypeGuard[type[HonoursLayerAttention]]:
    return isinstance(cls, HonoursLayerAttention)


# --------------------------------------------------------------------------- models


@runtime_checkable
class SupportsWeightBuffer(Protocol):
    """A model, or a linear method, that may hold every weight a batch-1 step reads in one
    buffer; the engine's bandwidth-floor probe (SupportsWeightReadProbe) reads it."""

    def weight_buffer(self) -> torch.Tensor | None:
        """That buffer, or None where the weights are not kept in one."""
        ...


def supports_weight_buffer(model: object) -> TypeGuard[SupportsWeightBuffer]:
    return isinstance(model, SupportsWeightBuffer)


@runtime_checkable
class SupportsPipelineStages(Protocol):
    """A model class that can be built for one pipeline stage (`stage=`, a
    worker.parallel.PipelineStage: it then holds that stage's layers only) and run it.
    plugserve.worker.models.decoder.DecoderForCausalLM offers it to every family."""

    def forward_stage(self, input_ids: Any, positions: Any, previous: Any) -> Any:
        """The first stage embeds `input_ids`, the others continue from the `previous`
        stage's activations; the last returns the final hidden states [tokens, hidden],
        the others their activations for the next stage."""
        ...


def supports_pipeline_stages(cls: object) -> TypeGuard[type[SupportsPipelineStages]]:
    return isinstance(cls, SupportsPipelineStages)


@runtime_checkable
class HasLayerAttention(Protocol):
    """A model class whose layers attend other than full causal at 1/sqrt(head_dim)
    (sliding windows, soft-capping, another scale); the model runner asks it before the
    attention backend is built and hands the answer over in AttentionSpec.layers. The
    family decides: a config's `sliding_window` alone means nothing (Qwen2's configs carry
    one with use_sliding_window false)."""

    @classmethod
    def attention_layers(cls, hf_config: Any) -> list[LayerAttention]:
        """One interfaces.model.LayerAttention per decoder layer."""
        ...


def has_layer_attention(cls: object) -> TypeGuard[type[HasLayerAttention]]:
    return isinstance(cls, HasLayerAttention)


@runtime_checkable
class HasTiedLmHead(Protocol):
    """A model whose LM head may be its embedding matrix (tied embeddings): the loader gives
    that head a linear method too, so it runs as the other linears do."""

    def tied_lm_head(self) -> TiedLmHead | None:
        """The embedding that is also the LM head, or None where the head is its own
        linear layer."""
        ...


def has_tied_lm_head(model: object) -> TypeGuard[HasTiedLmHead]:
    return isinstance(model, HasTiedLmHead)


@runtime_checkable
class TakesTokenTypeIds(Protocol):
    """A model whose forward also takes `token_type_ids` ([T] long, the segment of each
    token: BERT's sentence pairs); the model runner passes them where a request has them."""

    takes_token_type_ids: bool


def takes_token_type_ids(model: object) -> TypeGuard[TakesTokenTypeIds]:
    return isinstance(model, TakesTokenTypeIds) and bool(model.takes_token_type_ids)


@runtime_checkable
class BuildsWithoutLmHead(Protocol):
    """A model class that a pooling runner builds without its LM head (`lm_head=False`):
    the final hidden states are what it pools, so the head (vocabulary x hidden) is
    neither held nor looked for in the checkpoint, which may have none (Qwen3-Embedding's
    are saved from the base model). plugserve.worker.models.decoder.DecoderForCausalLM
    offers it to every decoder family."""

    builds_without_lm_head: bool


def builds_without_lm_head(cls: object) -> TypeGuard[type[BuildsWithoutLmHead]]:
    return isinstance(cls, BuildsWithoutLmHead) and bool(cls.builds_without_lm_head)


@runtime_checkable
class HasClassifier(Protocol):
    """A pooling model with a classification head (a ForSequenceClassification): the
    pooled hidden states go through it for the classify and score tasks."""

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled [N, hidden] → fp32 logits [N, num_labels]."""
        ...


def has_classifier(model: object) -> TypeGuard[HasClassifier]:
    return isinstance(model, HasClassifier)


@runtime_checkable
class HasContextLimit(Protocol):
    """A model class whose context is bounded otherwise than by max_position_embeddings
    (XLM-R's position ids start at padding_idx + 1)."""

    @classmethod
    def context_limit(cls, hf_config: Any) -> int: ...


def has_context_limit(cls: object) -> TypeGuard[type[HasContextLimit]]:
    return isinstance(cls, HasContextLimit)


# --------------------------------------------------------------------------- linear methods


@runtime_checkable
class DescribesLinears(Protocol):
    """A linear method that says how its layers run once processed (the kernels, the
    quantization): the model runner's start-up line."""

    def describe(self) -> str: ...


def describes_linears(method: object) -> TypeGuard[DescribesLinears]:
    return isinstance(method, DescribesLinears)


@runtime_checkable
class SupportsCpuLinearCall(Protocol):
    """A layer's installed matmul (interfaces.model.LinearCompute) whose kernel is C++ and
    can be called from C++: the fused bf16 CPU decoder then runs the whole layer stack in
    one op over it, as over its own packed weights."""

    def cpu_linear_call(self) -> tuple[int, int]:
        """Two addresses: a `plugserve::LinearCallFn` (plugserve/ops/include/
        layer_linear.h) and the context it takes, valid while this object lives."""
        ...


def supports_cpu_linear_call(compute: object) -> TypeGuard[SupportsCpuLinearCall]:
    return isinstance(compute, SupportsCpuLinearCall)


# Set to 1 in a process, a linear method with HasKernelPlan measures its plan again rather
# than read the one it cached for this machine (`plugserve bench kernels` sets it).
REMEASURE_KERNELS_ENV = "PLUGSERVE_REMEASURE_KERNELS"


@runtime_checkable
class KernelMeasurement(Protocol):
    """How a linear method chose its kernels by timing them on the model's own weights,
    as `plugserve bench kernels` prints it."""

    def cpu_model(self) -> str:
        """The CPU it was measured on (what the plan is kept by)."""
        ...

    def describe(self) -> str:
        """Lines saying what was timed (how much of the weights, how many rounds), the plan
        chosen, and where it is kept (or why not)."""
        ...

    def table(self) -> str:
        """The timings, one row per row bucket, one column per kernel, the chosen starred
        (markdown)."""
        ...


@runtime_checkable
class HasKernelPlan(Protocol):
    """A linear method that runs its layers by a kernel plan it measured on this machine
    (the bf16 CPU kernels: which kernel each row count runs): a model pass fusing layers
    over its weights follows the same plan, and `plugserve bench kernels` prints how it was
    chosen. Both are None before processing and where nothing was packed."""

    kernel_plan: Any  # the method's own plan type
    kernel_measurement: KernelMeasurement | None


def has_kernel_plan(method: object) -> TypeGuard[HasKernelPlan]:
    return isinstance(method, HasKernelPlan)


# --------------------------------------------------------------------------- KV allocators


@runtime_checkable
class FreesBlocksPastTokens(Protocol):
    """A KV allocator that can give back a request's last blocks while it runs:
    speculative decoding frees, right after verification, the blocks that held only
    rejected draft tokens (and a worker-side proposer's scratch entries). Without it a
    request keeps them until it ends."""

    def free_blocks_past(self, request: Request, num_tokens: int) -> int:
        """Release the request's blocks past those its first `num_tokens` tokens need
        (none of them holds a token it keeps); returns how many were released."""
        ...


def frees_blocks_past_tokens(kv: object) -> TypeGuard[FreesBlocksPastTokens]:
    return isinstance(kv, FreesBlocksPastTokens)


# --------------------------------------------------------------------------- structured output


@runtime_checkable
class SupportsGrammarRollback(Protocol):
    """A Grammar (interfaces.structured_output) that can undo tokens it accepted: what
    speculative decoding needs to check draft tokens against it and to build a bitmask
    row at every draft position. A request whose grammar cannot is not speculated for."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        ...


def supports_grammar_rollback(grammar: object) -> TypeGuard[SupportsGrammarRollback]:
    return isinstance(grammar, SupportsGrammarRollback)


# --------------------------------------------------------------------------- speculative proposers


@runtime_checkable
class ProposesInWorker(Protocol):
    """A spec proposer class (built like a SpecProposer, with `num_tokens`, `vocab_size`
    and its options) that proposes in the model runner instead of the engine core: the
    runner builds it on every rank, loads the model it names beside the target with a
    KV cache of its own (interfaces.speculative.ProposerModel), and after each step's
    sampling asks it for the next drafts, which return with the step's output. The
    engine gives every request it schedules to the end of its tokens room for the
    proposer's writes: `num_tokens` KV slots past them. It needs no `propose` or
    `request_finished`: the engine core never builds it."""

    def proposer_model(self) -> str:
        """The model to load for it: a built-in name, a Hugging Face folder or a GGUF
        file, with the served model's vocabulary."""
        ...

    def propose_in_worker(
        self, model: ProposerModel, requests: WorkerDraftRequests
    ) -> list[list[int]]:
        """One proposal per request, in order, at most its `max_num_tokens` tokens (maybe
        none). Called on every rank with the same requests; every rank must return the
        same proposals (`model.share` gives each rank the driver's tokens)."""
        ...


def proposes_in_worker(cls: object) -> TypeGuard[type[ProposesInWorker]]:
    return isinstance(cls, ProposesInWorker)
