"""Every plugserve hook, grouped by the phase of the request path it serves.

Slot hooks only discover: each receives `register(name, cls)` and calls it once per
implementation it provides. The core builds the objects that stack.yaml selects and the
hot path calls them directly. A plugin module implements any subset of these with
`@plugserve.hookimpl`; it is found through the `plugserve` entry-point group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from plugserve.interfaces.frontend import ApiServer

hookspec = pluggy.HookspecMarker("plugserve")

# register(name, cls): `cls` may also be a "module:Class" reference, imported only when
# the implementation is first used (so a process that never builds it never imports it).
Register = Callable[[str, "type | str"], None]


# --------------------------------------------------------------- API-server process


@hookspec
def register_renderers(register: Register) -> None:
    """Register Renderer classes (interfaces.frontend.Renderer): conversation → prompt token ids.

    Called once per process when the plugin registry is first used. `register(name, cls)`;
    stack.yaml selects one with `stack.renderer`.
    """


@hookspec
def register_detokenizers(register: Register) -> None:
    """Register Detokenizer classes (interfaces.frontend.Detokenizer), built once per request to
    turn new token ids into new text and check stop strings. Selected by
    `stack.detokenizer`."""


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register ToolParser classes (interfaces.frontend.ToolParser) that find tool calls in a model
    family's output text when a request offers tools with `tool_choice: "auto"`. Selected
    by `stack.tool_parser`."""


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register ReasoningParser classes (interfaces.reasoning.ReasoningParser) that split
    a reasoning model's output into its thinking and its answer, and name the ids that
    end the thinking, where a grammar starts to apply and a thinking budget forces the
    end. Selected by `stack.reasoning_parser` (default none: the output is all answer)."""


@hookspec
def register_metrics(registry: Any, model_name: str) -> None:
    """Add metrics to /metrics. Called once in every API-server process, after its
    engines have started, with the `prometheus_client.CollectorRegistry` that process's
    /metrics serves and the served model's name.

    Register a custom collector (`registry.register(collector)`: its `collect()` runs
    at each scrape, in whichever API server answers it), or create prometheus-client
    metrics on it (`Counter(..., registry=registry)`); with several API servers
    (`server.api_server_count` > 1) the values of such metrics are summed over the
    processes through prometheus-client's multiprocess mode, and a Gauge needs a
    `multiprocess_mode` saying how to combine them.
    """


@hookspec
def register_routes(server: ApiServer) -> None:
    """Add HTTP endpoints to the API server. Called once in every API-server process while
    its app is built, after its engines have started, with `server`
    (interfaces.frontend.ApiServer): `server.include_router(router)` serves a `fastapi.APIRouter`'s
    routes; `server.engine_client`, `server.renderer`, `server.config`,
    `server.model_name` and `server.max_model_len` are what they serve with.

    The routes pass the gate every request passes (the API key on /v1/ paths, the request
    id, 503 while draining). What a route raises before its response starts is answered
    in OpenAI's error shape: an `HTTPException` with its status, and what the engine
    client raises (429 with Retry-After past `engine.max_waiting_requests`, which counts
    each of its requests as it counts the bundled endpoints'; 503 once an engine is dead).
    A method and path already served, by a bundled endpoint or another plugin, is an
    error naming both. The bundled endpoints register through this hook too, first.
    """


# --------------------------------------------------------------- between the processes


@hookspec
def register_transports(register: Register) -> None:
    """Register Transport classes (interfaces.transport.Transport) that carry encoded frames between
    the API-server and engine-core processes. Selected by `stack.transport`."""


# --------------------------------------------------------------- engine-core process


@hookspec
def register_scheduler_policies(register: Register) -> None:
    """Register SchedulingPolicy classes (interfaces.scheduling.SchedulingPolicy): the order of the
    waiting queue and the choice of preemption victim. Selected by `stack.scheduler`."""


@hookspec
def register_kv_allocators(register: Register) -> None:
    """Register KVAllocator classes (interfaces.kv_cache.KVAllocator): block pool, block tables and
    prefix cache. Selected by `stack.kv_allocator`."""


@hookspec
def register_executors(register: Register) -> None:
    """Register Executor classes (interfaces.executor.Executor) that run the model for the engine:
    in-process or across worker processes. Selected by `stack.executor`."""


@hookspec
def register_structured_output_backends(register: Register) -> None:
    """Register StructuredOutputBackend classes (interfaces.structured_output.StructuredOutputBackend) that
    compile JSON schemas, regexes, EBNF grammars and choice lists into per-request
    grammars whose token bitmask masks the logits. Selected by `stack.structured_output`;
    the API server also calls the class's `validate`."""


@hookspec
def register_spec_proposers(register: Register) -> None:
    """Register SpecProposer classes (interfaces.speculative.SpecProposer) that guess each
    decoding request's next tokens for speculative decoding; the target model verifies
    the guesses in one pass. Selected by `stack.speculative.proposer` (speculation is off
    while `stack.speculative` is unset); options from `plugins.<name>`."""


# --------------------------------------------------------------- worker


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register AttentionBackend classes (interfaces.model.AttentionBackend): KV cache layout and
    paged varlen attention kernels. Selected by `stack.attention`."""


@hookspec
def register_linear_methods(register: Register) -> None:
    """Register LinearMethod classes (interfaces.model.LinearMethod): how linear layers hold and
    multiply their weights (quantized, packed for a kernel, with adapters). Selected by
    `stack.linear_method` for every linear layer of the model (the LM head included, tied
    or not; the embedding lookup keeps its rows); None (the default) leaves it to the
    dtype and device. Register by "module:Class" reference where the class imports
    worker code: the API-server process loads every plugin module."""


@hookspec
def register_model_passes(register: Register) -> None:
    """Register ModelPass classes (interfaces.model.ModelPass): rewrites of how a loaded
    model's decoder layers run (fused layers, the whole stack as one op, instrumentation),
    applied once after the linear methods processed the weights. Selected by
    `stack.model_passes`, a list applied in order; None (the default) applies the bundled
    automatic ones (config.AUTOMATIC_MODEL_PASSES) where registered, so that an installed
    pass never applies unasked; [] applies none. Register by "module:Class" reference
    where the class imports worker code."""


@hookspec
def register_poolers(register: Register) -> None:
    """Register Pooler classes (interfaces.pooling.Pooler) that turn the final hidden
    states of a pooling request's prompt into its one vector (last token, mean, CLS, ...).
    Selected by `stack.pooler`; None (the default) takes the checkpoint's
    sentence-transformers pooling config (1_Pooling/config.json), else `cls` for an
    encoder or classifier and `last` for a decoder. Built once per model load; called
    in the worker after every step in which a pooling request's last prompt chunk ran."""


@hookspec
def register_models(register: Register) -> None:
    """Register model classes (interfaces.model.CausalLM) under the Hugging Face architecture
    names they implement, e.g. `register("LlamaForCausalLM", LlamaForCausalLM)`, or by
    reference, `register("LlamaForCausalLM", "my_models.llama:LlamaForCausalLM")`, so the
    API-server process, which never builds a model, never imports its code. The model's
    config.json `architectures` picks one."""


# --------------------------------------------------------------- observers


@hookspec
def request_finished(
    request_id: str, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int
) -> None:
    """Called in the engine-core process when a request finishes for any reason. For
    metrics and logging plugins; must be cheap, it runs on the engine's loop."""


@hookspec
def engine_step_finished(stats: Any) -> None:
    """Called in the engine-core process after every step with the step's StepStats
    (scheduled tokens, running and waiting counts, KV usage, step and forward times)."""
