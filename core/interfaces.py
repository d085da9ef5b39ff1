"""The contract of every swappable part: one typing.Protocol per slot.

A plugin registers a class for a slot (see hookspecs.py); the core builds it with the
keyword arguments documented on the Protocol's `__init__` plus, when the class declares
an `Options` pydantic model, `options=` validated from its block under `plugins:` in
stack.yaml. The hot path calls these objects directly, never through pluggy.

What a part may offer beyond its slot's Protocol is a capability, declared in
plugserve.capabilities with a `supports_x(obj)` check. RankedPolicy, beside the
SchedulingPolicy Protocol, is a base class: a scheduling policy written on it is only its
rank function. ApiServer and EngineClient are no slot's: they are what the
`register_routes` hook hands a plugin that adds endpoints.

The types these Protocols speak in (Request, SchedulerOutput, ModelRunnerOutput,
RequestDelta) live in plugserve.datatypes; this module imports no engine, worker or
frontend module.
"""

from __future__ import annotations

import heapq
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch

    from plugserve.config import StackConfig
    from plugserve.datatypes import (
        GrammarOutput,
        ModelRunnerOutput,
        Request,
        RequestDelta,
        SchedulerOutput,
    )
    from plugserve.sampling_params import SamplingParams, StructuredOutputsParams


# --------------------------------------------------------------------------- frontend


@runtime_checkable
class Renderer(Protocol):
    """Conversation or text → prompt token ids (phase 1). Built once per process."""

    tokenizer: Any  # a transformers tokenizer; detokenizers are given it
    eos_token_id: int | None

    def __init__(self, *, model_path: str) -> None: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Apply the chat template and tokenize; raise ValueError for a malformed
        conversation. `messages` are OpenAI's (assistant turns may carry `tool_calls`
        with content None, `tool` turns a `tool_call_id`). `tools` (OpenAI's function
        tools) reach the template as transformers' `apply_chat_template(tools=...)`
        passes them. `continue_final_message`: the last message is the assistant's and
        stays open, for the model to continue (not with `add_generation_prompt`).
        `chat_template`: a template given with the request, instead of the model's."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...


@runtime_checkable
class Detokenizer(Protocol):
    """Per-request, stateful: new token ids → new text (phase 11). Built once per request."""

    output_text: str
    stop_reason: str | None  # the stop string that matched, once one has

    def __init__(
        self, *, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams
    ) -> None: ...

    def update(self, new_token_ids: list[int]) -> str:
        """Append ids; return the text they add. Checks stop strings on the new window only;
        after a match `stop_reason` is set and the text is cut as the params ask. Text
        that might still become a stop string is held back."""
        ...

    def flush(self) -> str:
        """The request ended for another reason (EOS, stop token, length, abort): return
        the held-back text; `output_text` is final afterwards."""
        ...


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A finished output split into the text meant for the user and the calls."""

    content: str | None
    tool_calls: list[ToolCall]


@runtime_checkable
class ToolParser(Protocol):
    """Finds tool calls in the text of a model family's output (`tool_choice: "auto"`).
    Built once per request that offers tools, so it may keep streaming state."""

    def __init__(self, *, tokenizer: Any, tools: list[dict[str, Any]]) -> None: ...

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The whole output at once (non-streamed responses)."""
        ...

    def extract_tool_calls_streaming(self, delta_text: str) -> tuple[str, list[ToolCall]]:
        """Streamed: feed the new text; returns (text to show as content now, calls
        completed by it). Text that may belong to a call is held back until it is known."""
        ...

    def finish_streaming(self) -> tuple[str, list[ToolCall]]:
        """Streamed: the output ended. Returns what was held back: text that turned out
        not to be a call, and a last call the model did not close."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """The API server's handle on its engines, as an endpoint plugin generates through it."""

    @property
    def is_dead(self) -> bool:
        """True once an engine has died: nothing more will be generated."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        """Submit one request (one sequence, whatever `params.n`) and yield its deltas
        until the one that finishes it; leaving the iteration early aborts it.
        `request_id` must be unique among the requests in flight. The engine's failure
        on this request raises in the iteration, as does a dead engine."""
        ...


@runtime_checkable
class ApiServer(Protocol):
    """One API-server process as `register_routes` shows it to a plugin: where its routes
    go, and what they serve with."""

    config: StackConfig  # the server's validated stack.yaml and overrides
    model_name: str  # as clients name it (server.served_model_name, else the model)
    renderer: Renderer  # the stack's renderer: the served tokenizer and chat template
    engine_client: EngineClient

    @property
    def max_model_len(self) -> int:
        """The context the engines were started with: prompt and output tokens together."""
        ...

    def include_router(self, router: Any) -> None:
        """Serve a `fastapi.APIRouter`'s routes from this API server. A method and path
        that another plugin or a bundled endpoint already serves is an error naming both."""
        ...


# --------------------------------------------------------------------------- transport


Frames = list[bytes | memoryview]


@runtime_checkable
class ClientChannel(Protocol):
    """An API server's end: asyncio, one per API-server process. With several API
    servers (`server.api_server_count`), each has a channel of its own to every engine,
    opened with its client index."""

    async def wait_ready(self, timeout: float) -> Frames:
        """The next handshake from an engine that has not sent one yet (called once per
        engine). Raises TimeoutError."""
        ...

    async def send(self, frames: Frames, engine: int = 0) -> None:
        """A request-side message to engine number `engine`; never blocks the event loop
        for long."""
        ...

    async def recv(self) -> Frames:
        """The next message from any engine to this client (the messages say which
        engine sent them)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class EngineChannel(Protocol):
    """An engine core's end, joined to every client: blocking calls, each used by one
    thread only (the input IO thread receives, the output IO thread sends). Clients are
    numbered 0 <= client < num_clients; the engine answers each on the client it heard
    the request from."""

    def send_ready(self, frames: Frames) -> None:
        """The handshake, to every client; the engine speaks first."""
        ...

    def recv(self, timeout: float | None = None) -> tuple[int, Frames] | None:
        """The next request-side message from any client, as (client, frames), or None
        after `timeout` seconds. No client can starve the others."""
        ...

    def send(self, frames: Frames, client: int = 0) -> None:
        """A message to client number `client` only."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """Moves frames (lists of bytes-like objects) between the API-server and engine-core
    processes. The core encodes messages; a transport only moves frames. Built in the
    launching process, which calls `addresses()` and passes them, with the transport's
    name and options, to each side; each side builds the transport again and opens its
    end: every client (API server) and every engine once."""

    def __init__(self, *, options: Any = None) -> None: ...

    def addresses(self, num_engines: int = 1, num_clients: int = 1) -> dict[str, str]:
        """Fresh, opaque addresses (ports picked free, temporary paths or names) for
        `num_engines` engines (data parallelism) each serving `num_clients` clients (API
        servers); picklable strings."""
        ...

    def client(self, addresses: dict[str, str], client: int = 0) -> ClientChannel:
        """Open client number `client`'s end (in its event loop's thread)."""
        ...

    def engine(self, addresses: dict[str, str], engine: int = 0) -> EngineChannel:
        """Open engine number `engine`'s end (0 <= engine < num_engines), to every
        client."""
        ...


# --------------------------------------------------------------------------- engine


@runtime_checkable
class SchedulingPolicy(Protocol):
    """The waiting queue's order, and whom to preempt when KV blocks run out."""

    def __init__(self) -> None: ...

    def add(self, request: Request) -> None:
        """A newly arrived request joins the waiting queue."""
        ...

    def prepend(self, request: Request) -> None:
        """A preempted request rejoins; it should not lose its place to later arrivals."""
        ...

    def peek(self) -> Request:
        """The next request to admit (the queue is not empty)."""
        ...

    def pop(self) -> Request: ...

    def remove(self, requests: Iterable[Request]) -> None:
        """Drop aborted requests, wherever they are in the queue."""
        ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...

    def select_victim(self, running: Sequence[Request]) -> Request:
        """Which running request to preempt (recompute) when KV blocks run out. `running`
        holds the running requests not yet scheduled this step, in admission order, the
        one that needs blocks among them; choosing that one makes it give way."""
        ...


class RankedPolicy(ABC):
    """A SchedulingPolicy that is its rank function: a subclass defines only `rank`.

    Waiting requests run lowest rank first, equal ranks in arrival order; a preempted
    request rejoins at the place its rank and arrival give it, ahead of later arrivals of
    its rank. The running request with the highest (rank, arrival) is preempted first."""

    def __init__(self) -> None:
        # (rank, arrival, insertion count, request): the count differs between any two
        # entries, so the heap never compares two Requests.
        self._heap: list[tuple[Any, float, int, Request]] = []
        self._insertions = itertools.count()

    @abstractmethod
    def rank(self, request: Request) -> Any:
        """The request's key, lower runs first: any ordered value (a number, a tuple).
        Read when the request joins the queue and again when a victim is chosen."""

    def _order(self, request: Request) -> tuple[Any, float]:
        return (self.rank(request), request.arrival_time)

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*self._order(request), next(self._insertions), request))

    def prepend(self, request: Request) -> None:
        # Its arrival time already keeps a preempted request ahead of later arrivals.
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap, key=lambda entry: entry[:3]))

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=self._order)


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int  # free, including cached blocks that no request holds
    num_cached_blocks: int  # blocks findable by hash
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found in the cache

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@runtime_checkable
class KVAllocator(Protocol):
    """Owns which KV-cache blocks hold which request's tokens (phase 6)."""

    block_size: int
    num_blocks: int

    def __init__(
        self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool
    ) -> None: ...

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest prefix of the request's tokens already cached, in full blocks:
        (block ids, number of tokens). Never the whole request: at least one token is left
        to compute, so the model produces logits. Takes no references; updates hit stats."""
        ...

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Room for `num_new_tokens` tokens after the request's computed ones (plus the
        prefix-cache hit passed in, on its first allocation). Returns the block ids appended
        to the request's table, or None, changing nothing, if the pool cannot give them.
        Full blocks among the tokens being computed become findable by their hash."""
        ...

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        ...

    def free(self, request: Request) -> None:
        """Release the request's blocks (cached ones stay findable until evicted)."""
        ...

    @property
    def num_free_blocks(self) -> int: ...

    def stats(self) -> KVCacheStats: ...

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False if blocks are still held by requests."""
        ...


@dataclass(frozen=True)
class KVCacheInfo:
    """What the executor reports once the model is loaded and the KV cache allocated."""

    num_blocks: int
    block_size: int
    dtype: str
    max_model_len: int


@runtime_checkable
class Executor(Protocol):
    """Runs the model for the engine core: in-process, or over worker processes.

    Optional: HasTensorParallelLimit, SupportsWeightReadProbe."""

    def __init__(self, *, config: StackConfig) -> None: ...

    def initialize(self) -> KVCacheInfo:
        """Load the model, size and allocate the KV cache."""
        ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Future[ModelRunnerOutput | None] | ModelRunnerOutput | None:
        """Phase 7: run the forward pass over the scheduled tokens and park the logits.
        Returns None (or a Future of None with non_block) when there is something to
        sample; a ModelRunnerOutput directly when there is not."""
        ...

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Phase 8: mask the parked logits of constrained rows with the grammar bitmask,
        apply the logits processors and sample."""
        ...

    def check_health(self) -> None:
        """Raise if a worker is gone."""
        ...

    def shutdown(self) -> None: ...


@runtime_checkable
class Grammar(Protocol):
    """One request's compiled constraint and where its output stands in it."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 [rows, ceil(vocab/32)]
        bitmask (layout: datatypes.GrammarOutput)."""
        ...

    def is_terminated(self) -> bool:
        """The constraint is complete and a stop token was accepted after it: the request
        finishes with `stop`. (A complete constraint allows only the stop tokens.)"""
        ...


@runtime_checkable
class StructuredOutputBackend(Protocol):
    """Compiles structured-output constraints into Grammars for one tokenizer. Built once
    per engine process; `compile` runs on a worker thread, off the engine's loop, and the
    engine keeps what it returns (one cache for every backend)."""

    def __init__(self, *, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        """`vocab_size` is the model's logits width (it may exceed the tokenizer's)."""
        ...

    @classmethod
    def validate(cls, spec: StructuredOutputsParams) -> None:
        """Raise ValueError naming the problem (bad schema, regex, grammar) without a
        tokenizer: the API server calls it so a bad request gets a 400 before it queues."""
        ...

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The constraint compiled for this tokenizer: immutable, shared by every request
        with the same constraint (the engine caches it by `spec.key`); ValueError for a
        constraint this tokenizer cannot compile."""
        ...

    def grammar(self, compiled: Any) -> Grammar:
        """A fresh Grammar over a compiled constraint, for one request."""
        ...


# --------------------------------------------------------------------------- worker


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

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive, got {self.logit_softcap}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"scale must be positive, got {self.scale}")

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
